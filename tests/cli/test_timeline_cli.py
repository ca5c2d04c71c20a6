"""The command line's timeline and comparison pictures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopipe.cli import inputs as cli
from autopipe.planning.model.plans import Plan
from tests.support.cli_support import MLP, assert_error, run


def test_cli_timeline(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    picture, plan_file = tmp_path / "timeline.png", tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--timeline",
        str(picture),
        "--json",
        str(plan_file),
    )
    assert code == 0, err
    assert "balance" in out
    assert f"timeline written to {picture}" in err
    assert picture.read_bytes().startswith(b"\x89PNG")
    assert Plan.load(plan_file).balance  # the picture did not replace the plan


def test_cli_compare(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    picture = tmp_path / "compare.svg"
    code, _, err = run(
        capsys,
        "plan",
        "--profile",
        str(profile_file),
        "--stages",
        "3",
        "--schedule",
        "1f1b",
        "--compare",
        str(picture),
    )
    assert code == 0, err
    assert f"comparison written to {picture}" in err
    text = picture.read_text()
    assert "<svg" in text


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("t.pdf", "use a .png or .svg"),
        ("missing/t.png", "does not exist"),
        (".", "use a .png or .svg"),
    ],
)
@pytest.mark.parametrize("option", ["--timeline", "--compare"])
def test_cli_bad_picture_path(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    option: str,
    name: str,
    expected: str,
) -> None:
    def no_profiling(path: str) -> None:
        raise AssertionError("the picture path must be checked before profiling")

    monkeypatch.setattr(cli, "_load", no_profiling)
    plan_file = tmp_path / "plan.json"
    code, out, err = run(
        capsys, "plan", MLP, option, str(tmp_path / name), "--json", str(plan_file)
    )
    assert_error(code, out, err, expected)
    assert not plan_file.exists()


def test_cli_directory_as_picture(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "pic.png"
    folder.mkdir()
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--timeline", str(folder))
    assert_error(code, out, err, "is a directory")


def test_cli_missing_matplotlib(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(cli, "_load", lambda path: pytest.fail("profiled before checking"))
    code, out, err = run(capsys, "plan", MLP, "--timeline", str(tmp_path / "t.png"))
    assert_error(code, out, err, "needs matplotlib")
    assert list(tmp_path.iterdir()) == []
