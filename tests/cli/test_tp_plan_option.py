"""``--tp-plan FILE`` and a Hugging Face model's own plan on the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    SMALL_MODEL,
    assert_error,
    counted_profiles,
    llama_file,
    run,
)

PLAN = {"0": "colwise", "2": "rowwise"}


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.py"
    path.write_text(SMALL_MODEL)
    return path


def _plan_file(tmp_path: Path, plan: object) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_profile_counts_the_plan(
    capsys: pytest.CaptureFixture[str], model_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "small.profile.json"
    argv = [
        "profile",
        str(model_file),
        "-o",
        str(out_file),
        "--tp-plan",
        _plan_file(tmp_path, PLAN),
    ]
    code, _, err = run(capsys, *argv, *FAST)
    assert code == 0, err
    first, _, last = (layer.shards for layer in Profile.load(out_file).layers)
    assert first is not None and last is not None
    # Linear(4, 8): weight and bias sharded; its sharded output leaves the layer gathered.
    assert first.param_bytes == 4 * (8 * 4 + 8)
    assert first.reductions == 1
    assert last.param_bytes == 4 * 2 * 8  # Linear(8, 2)'s weight; its bias is replicated
    code, _, err = run(capsys, "profile", str(model_file), "-o", str(out_file), *FAST)
    assert code == 0, err
    assert all(layer.shards is None for layer in Profile.load(out_file).layers)


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ({"0": "diagonal"}, "gives '0' the unknown style 'diagonal'; use one of colwise"),
        ({"9": "colwise"}, "pattern '9' matches no module of Sequential"),
        (["0"], "must map module-name patterns to style names"),
    ],
)
def test_a_bad_plan_is_one_line(
    capsys: pytest.CaptureFixture[str],
    model_file: Path,
    tmp_path: Path,
    plan: object,
    expected: str,
) -> None:
    argv = ["plan", str(model_file), "--stages", "2", "--tp-plan", _plan_file(tmp_path, plan)]
    assert_error(*run(capsys, *argv, *FAST), expected)


def test_a_saved_profile_takes_no_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["plan", "--profile", str(tmp_path / "p.json"), "--tp-plan", _plan_file(tmp_path, PLAN)]
    assert_error(*run(capsys, *argv), "--tp-plan is counted while profiling")


def test_target_counts_a_hugging_face_models_own_plan(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    made = counted_profiles(capsys, monkeypatch, llama_file(tmp_path))
    blocks = [layer.shards for layer in made[0].layers if "layers" in layer.name]
    assert len(blocks) == 2
    assert all(s is not None and (s.heads, s.kv_heads, s.reductions) == (4, 2, 2) for s in blocks)
