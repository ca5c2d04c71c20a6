"""Tests of the source index (autopipe.cli.source_index): a model file whose inputs did not
change is not run again to plan, and any change to what it read runs it again."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from autopipe.cli import source_index
from tests.support.cli_support import (
    plan_after_change,
    plan_twice,
    plan_two_stages,
    write_model_file,
)

# Every run of the file appends a line to runs.txt (a write, which the index ignores), so
# the number of lines is the number of times the file ran.
MODEL = """import json
import os
from pathlib import Path

import torch
from torch import nn

from helper import WIDTH

here = Path(__file__).parent
with open(here / "runs.txt", "a") as log:
    log.write("ran\\n")
config = json.loads((here / "config.json").read_text())
width = int(os.environ.get("INDEX_TEST_WIDTH", WIDTH)) * config["scale"]
model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
sample = torch.randn(8, 4)
"""


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    beside = {"helper.py": "WIDTH = 4\n", "config.json": '{"scale": 2}'}
    return write_model_file(tmp_path, MODEL, beside)


def runs(path: Path) -> int:
    log = path.parent / "runs.txt"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_an_unchanged_file_does_not_run_again(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    (first, _), (second, err) = plan_twice(capsys, model_file)
    assert runs(model_file) == 1
    assert "the model file did not run" in err
    assert second == first


def _edit_model(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path.write_text(MODEL + "# edited\n")


def _edit_helper(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (path.parent / "helper.py").write_text("WIDTH = 4  # edited\n")


def _edit_config(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (path.parent / "config.json").write_text('{"scale": 3}')


def _set_variable(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INDEX_TEST_WIDTH", "5")


def _other_version(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = source_index._version
    monkeypatch.setattr(
        source_index, "_version", lambda name: "0.0.0" if name == "torch" else real(name)
    )


@pytest.mark.parametrize(
    "change",
    [_edit_model, _edit_helper, _edit_config, _set_variable, _other_version],
    ids=["model-file", "imported-module", "opened-file", "environment", "distribution"],
)
def test_each_change_runs_the_file_again(
    capsys: pytest.CaptureFixture[str],
    model_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Path, pytest.MonkeyPatch], None],
) -> None:
    changed, again = plan_after_change(capsys, model_file, lambda: change(model_file, monkeypatch))
    assert "the model file did not run" not in changed
    # The new state is recorded in turn.
    assert runs(model_file) == 2 and "the model file did not run" in again


def test_another_micro_batch_count_runs_the_file_then_keeps_both(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    four, _ = plan_two_stages(capsys, model_file)  # batch 8 on 2 stages: 4 micro-batches
    two, _ = plan_two_stages(capsys, model_file, "--batch", "4")  # batch 4: 2 micro-batches
    assert runs(model_file) == 2
    again_four, err_four = plan_two_stages(capsys, model_file)
    again_two, err_two = plan_two_stages(capsys, model_file, "--batch", "4")
    assert runs(model_file) == 2
    assert "did not run" in err_two and "did not run" in err_four
    assert (again_two, again_four) == (two, four)


def test_no_cache_runs_the_file(capsys: pytest.CaptureFixture[str], model_file: Path) -> None:
    changed, _ = plan_after_change(capsys, model_file, None, "--no-cache")
    assert runs(model_file) == 3 and "did not run" not in changed


def test_a_missing_profile_entry_runs_the_file(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    from autopipe.cli import cache

    def remove() -> None:
        for entry in (cache.cache_dir() / "profiles").glob("*.json"):
            entry.unlink()

    changed, again = plan_after_change(capsys, model_file, remove)
    assert runs(model_file) == 2 and "profile: cached" not in changed
    assert "did not run" in again


def test_a_damaged_index_runs_the_file(
    capsys: pytest.CaptureFixture[str], model_file: Path
) -> None:
    from autopipe.cli import cache

    def damage() -> None:
        for entry in (cache.cache_dir() / "sources").glob("*.json"):
            entry.write_text("{not json")

    changed, again = plan_after_change(capsys, model_file, damage)
    # The profile still hit; the index was rewritten.
    assert changed.startswith("profile: cached (") and "did not run" not in changed
    assert runs(model_file) == 2 and "did not run" in again


def test_recording_notes_reads_not_writes(tmp_path: Path) -> None:
    read, written = tmp_path / "read.txt", tmp_path / "written.txt"
    read.write_text("x")
    with source_index.recording() as reads:
        read.read_text()
        written.write_text("y")
        os.environ.get("INDEX_TEST_UNSET_VARIABLE")
        _ = "HOME" in os.environ
    assert str(read) in reads.files and str(written) not in reads.files
    assert reads.environment["INDEX_TEST_UNSET_VARIABLE"] is None
    assert reads.environment["HOME"] == os.environ["HOME"]
    read.read_text()  # outside the block: not recorded anywhere
    os.environ.get("INDEX_TEST_AFTER")
    assert "INDEX_TEST_AFTER" not in reads.environment
