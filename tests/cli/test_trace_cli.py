"""The command line's ``--trace``: the plan's simulated step as a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.cli import inputs as cli
from autopipe.output.trace_events import trace
from autopipe.planning.model.plans import Plan
from tests.support.cli_support import MLP, assert_error, run


def test_cli_trace(capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path) -> None:
    path, plan_file = tmp_path / "step.json", tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--stages",
        "2",
        "--schedule",
        "1f1b",
        "--trace",
        str(path),
        "--json",
        str(plan_file),
    )
    assert code == 0, err
    assert "balance" in out
    assert f"trace written to {path}" in err
    document = json.loads(path.read_text())
    # The trace is the saved plan's predicted step, one track per device.
    assert document == json.loads(json.dumps(trace(Plan.load(plan_file))))
    pids = {e["pid"] for e in document["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}


def test_cli_search_trace(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    path, plan_file = tmp_path / "best.json", tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--search",
        "--devices",
        "2",
        "--trace",
        str(path),
        "--json",
        str(plan_file),
    )
    assert code == 0, err
    assert "the best plan" in out
    assert f"trace written to {path}" in err
    best = Plan.load(plan_file)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace(best)))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("step.png", "use a .json file name"),
        ("missing/step.json", "does not exist"),
        (".", "is a directory"),
    ],
)
@pytest.mark.parametrize("search", [False, True])
def test_cli_bad_trace_path(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    name: str,
    expected: str,
    search: bool,
) -> None:
    def no_profiling(path: str) -> None:
        raise AssertionError("the trace path must be checked before profiling")

    monkeypatch.setattr(cli, "_load", no_profiling)
    plan_file = tmp_path / "plan.json"
    extra = ["--search", "--devices", "2"] if search else []
    argv = ["plan", MLP, *extra, "--trace", str(tmp_path / name), "--json", str(plan_file)]
    code, out, err = run(capsys, *argv)
    assert_error(code, out, err, expected)
    assert not plan_file.exists()
