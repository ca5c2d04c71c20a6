"""Tests of the profile cache of ``autopipe plan`` and ``autopipe profile`` (autopipe.cli.cache)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import autopipe.graph.sequential
import profiler.measure
from autopipe.cli import cache
from profiler import jsonfile
from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    RESIDUAL_MODEL,
    assert_error,
    plan_after_change,
    plan_twice,
    plan_two_stages,
    run,
    write_model_file,
)

# The widths, the batch and the tie come from the environment, so that the structure and
# the sample change while the file's bytes do not.
MODEL = """import os

import torch
from torch import nn

from helper import WIDTH

width = int(os.environ.get("CACHE_TEST_WIDTH", WIDTH))
model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 2))
if os.environ.get("CACHE_TEST_TIE"):
    model[2].weight = nn.Parameter(torch.ones(width, width))
    model[2].weight = model[0].weight if width == 4 else model[2].weight
sample = torch.randn(int(os.environ.get("CACHE_TEST_BATCH", "8")), 4)
"""


class Counter:
    """Counts calls of a wrapped function."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.function(*args, **kwargs)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts the profiles measured (a hit measures none)."""
    counter = Counter(profiler.measure.profile_model)
    monkeypatch.setattr(profiler.measure, "profile_model", counter)
    return counter


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    return write_model_file(tmp_path, MODEL, {"helper.py": "WIDTH = '8'\n"})


def entries() -> list[Path]:
    return sorted((cache.cache_dir() / "profiles").glob("*"))


def test_second_run_plans_from_the_cache(
    capsys: pytest.CaptureFixture[str], model_file: Path, measured: Counter
) -> None:
    (first, err_first), (second, err) = plan_twice(capsys, model_file)
    assert "profile: cached" not in err_first
    assert measured.calls == 1  # not measured again
    [entry] = entries()
    assert err.splitlines() == [f"profile: cached ({entry}; the model file did not run)"]
    assert second == first


def test_a_hit_skips_the_trace(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    measured: Counter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    traced = Counter(autopipe.graph.sequential.unit_sequential)
    monkeypatch.setattr(autopipe.graph.sequential, "unit_sequential", traced)
    (first, _), (second, err) = plan_twice(capsys, path)
    assert (traced.calls, measured.calls) == (1, 1)
    assert "profile: cached" in err and second == first


def _edit_file(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.write_text(MODEL + "# edited\n")


def _edit_helper(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The same width as a string of other bytes: only the imported module's bytes change.
    (path.parent / "helper.py").write_text("WIDTH = '8'  # edited\n")


def _width(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_TEST_WIDTH", "6")


def _tie(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Same shapes, dtypes and bytes; only which parameters are one tensor changes.
    monkeypatch.setenv("CACHE_TEST_WIDTH", "4")
    monkeypatch.setenv("CACHE_TEST_TIE", "1")


def _batch(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_TEST_BATCH", "16")


def _torch_version(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "0.0.1")


def _autopipe_version(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "__version__", "0.0.1")


@pytest.mark.parametrize(
    ("change", "options"),
    [
        (_edit_file, []),
        (_edit_helper, []),
        (_width, []),
        (_batch, []),
        (_torch_version, []),
        (_autopipe_version, []),
        (None, ["--repeats", "2"]),
        (None, ["--chunks", "2"]),
        (None, ["--dtype", "bfloat16"]),
        (None, ["--autocast", "bfloat16"]),
    ],
    ids=[
        "model-file",
        "imported-module",
        "shape",
        "sample-shape",
        "torch-version",
        "autopipe-version",
        "repeats",
        "chunks",
        "dtype",
        "autocast",
    ],
)
def test_each_change_misses(
    capsys: pytest.CaptureFixture[str],
    model_file: Path,
    measured: Counter,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Path, pytest.MonkeyPatch], None] | None,
    options: list[str],
) -> None:
    act = None if change is None else lambda: change(model_file, monkeypatch)
    changed, again = plan_after_change(capsys, model_file, act, *options)
    assert "profile: cached" not in changed and len(entries()) == 2
    assert "profile: cached" in again and measured.calls == 2  # the new entry hits in turn


def test_tied_parameters_miss(
    capsys: pytest.CaptureFixture[str],
    model_file: Path,
    measured: Counter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CACHE_TEST_WIDTH", "4")
    changed, again = plan_after_change(
        capsys, model_file, lambda: monkeypatch.setenv("CACHE_TEST_TIE", "1")
    )
    assert "profile: cached" not in changed and "profile: cached" in again
    assert measured.calls == 2


@pytest.mark.parametrize(
    "content",
    ["{not json", json.dumps({"kind": "profile", "version": 1}), "", "\x00\x01"],
    ids=["not-json", "other-kind", "empty", "binary"],
)
def test_a_corrupted_entry_is_ignored_with_a_warning_and_rewritten(
    capsys: pytest.CaptureFixture[str], model_file: Path, measured: Counter, content: str
) -> None:
    plan_two_stages(capsys, model_file)
    [entry] = entries()
    entry.write_text(content)
    out, err = plan_two_stages(capsys, model_file)
    [line] = err.splitlines()
    assert line.startswith(f"autopipe: warning: ignoring the cached profile {entry} (")
    assert line.endswith("; profiling again")
    assert measured.calls == 2 and "balance" in out  # measured again, and planned
    assert Profile.from_dict(jsonfile.read_json(entry, "cached profile")["profile"])
    _, err = plan_two_stages(capsys, model_file)
    expected = [f"profile: cached ({entry}; the model file did not run)"]
    assert err.splitlines() == expected and measured.calls == 2


def test_an_entry_of_another_key_is_ignored(
    capsys: pytest.CaptureFixture[str], model_file: Path, measured: Counter
) -> None:
    plan_two_stages(capsys, model_file)
    [entry] = entries()
    data = jsonfile.read_json(entry, "cached profile")
    jsonfile.write_json(entry, "cached profile", {**data, "key": "0" * 64})
    _, err = plan_two_stages(capsys, model_file)
    assert "it holds another key" in err and measured.calls == 2


def test_an_invalid_cached_profile_is_ignored(
    capsys: pytest.CaptureFixture[str], model_file: Path, measured: Counter
) -> None:
    plan_two_stages(capsys, model_file)
    [entry] = entries()
    data = jsonfile.read_json(entry, "cached profile")
    data["profile"]["layers"][0]["forward"] = [-1.0] * len(data["profile"]["batch_sizes"])
    jsonfile.write_json(entry, "cached profile", data)
    _, err = plan_two_stages(capsys, model_file)
    assert "ignoring the cached profile" in err and "layers[0].forward" in err
    assert measured.calls == 2


def test_no_cache_neither_reads_nor_writes(
    capsys: pytest.CaptureFixture[str], model_file: Path, measured: Counter
) -> None:
    plan_two_stages(capsys, model_file, "--no-cache")
    assert entries() == []
    plan_two_stages(capsys, model_file)
    [entry] = entries()
    before = entry.read_bytes()
    _, err = plan_two_stages(capsys, model_file, "--no-cache")
    assert "profile: cached" not in err and measured.calls == 3
    assert entry.read_bytes() == before


def test_profile_command_uses_the_cache(
    capsys: pytest.CaptureFixture[str], model_file: Path, tmp_path: Path, measured: Counter
) -> None:
    outputs = [tmp_path / "a.json", tmp_path / "b.json"]
    for output in outputs:
        code, _, err = run(capsys, "profile", str(model_file), "-o", str(output), *FAST)
        assert code == 0, err
    assert "profile: cached" in err and measured.calls == 1
    first, second = (Profile.load(output).to_dict() for output in outputs)
    assert first == second


def test_a_hit_still_refuses_too_many_stages(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    plan_two_stages(capsys, model_file, "--chunks", "2")
    code, out, err = run(capsys, "plan", str(model_file), "--stages", "5", "--chunks", "2", *FAST)
    assert_error(code, out, err, "cannot split 4 layers into 5 non-empty stages")


def test_an_interrupted_write_leaves_no_entry(
    capsys: pytest.CaptureFixture[str], model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(source: str, target: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(jsonfile.os, "replace", fail)
    _, err = plan_two_stages(capsys, model_file)
    [line] = err.splitlines()
    assert line.startswith("autopipe: warning: cannot write the profile cache ")
    assert "No space left on device" in line
    folder = cache.cache_dir() / "profiles"
    assert list(folder.iterdir()) == []  # neither the entry nor a temporary file


def test_an_unwritable_cache_folder_is_a_warning(
    capsys: pytest.CaptureFixture[str],
    model_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(blocker))
    out, err = plan_two_stages(capsys, model_file)
    [line] = err.splitlines()
    assert line.startswith(f"autopipe: warning: cannot write the profile cache {blocker}")
    assert "balance" in out


def test_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOPIPE_CACHE_DIR", str(tmp_path / "given"))
    assert cache.cache_dir() == tmp_path / "given"
    monkeypatch.delenv("AUTOPIPE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "autopipe"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # ignored, as the XDG rule says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "autopipe"


CONSTANT_MODEL = """import os

import torch
from torch import nn


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        # A plain tensor attribute, neither parameter nor buffer: the trace bakes it in.
        self.factor = torch.full((3,), float(os.environ.get("CACHE_TEST_FACTOR", "2")))
        self.inp = nn.Linear(3, 3)
        self.out = nn.Linear(3, 3)

    def forward(self, x):
        return self.out(self.inp(x) * self.factor)


model = Scale()
sample = torch.randn(8, 3)
"""


def test_a_constant_tensors_value_is_in_the_key(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    measured: Counter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "constant.py"
    path.write_text(CONSTANT_MODEL)
    changed, again = plan_after_change(
        capsys, path, lambda: monkeypatch.setenv("CACHE_TEST_FACTOR", "3")
    )
    assert "profile: cached" not in changed and "profile: cached" in again
    assert measured.calls == 2


META_MODEL = """import torch
from torch import nn


def model():
    with torch.device("meta"):
        layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        layers.offset = torch.zeros(64)  # a constant without values
        return layers


sample = torch.randn(16, 64)
"""


def test_a_meta_model_for_a_target_hits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, measured: Counter
) -> None:
    path = tmp_path / "meta_model.py"
    path.write_text(META_MODEL)
    (first, _), (second, err) = plan_twice(capsys, path, "--target", "h100")
    assert "profile: cached" in err and measured.calls == 1
    assert second == first and "times estimated for" in second
