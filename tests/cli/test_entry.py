"""Tests of running the ``autopipe`` command: a subprocess, interrupts (autopipe.cli.entry)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autopipe.cli import entry
from tests.support.cli_support import FAST, MLP, ROOT, run


def test_subprocess() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "autopipe", "plan", "examples/mlp.py", *FAST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "balance" in proc.stdout and "uniform [8, 8]" in proc.stdout
    assert proc.stderr == ""


def test_interrupted_anywhere_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before any command runs: while the parser is built (and torch or scipy imported).
    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(entry, "build_parser", interrupt)
        code, out, err = run(capsys, "plan", MLP)
    assert (code, out, err) == (130, "", "autopipe: interrupted\n")


def test_interrupted_while_saving_leaves_no_file(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    profile_file: Path,
    tmp_path: Path,
) -> None:
    from profiler import jsonfile

    def interrupt(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonfile.os, "replace", interrupt)
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--profile", str(profile_file), "--json", str(out_file))
    assert (code, out, err) == (130, "", "autopipe: interrupted\n")
    assert list(tmp_path.iterdir()) == []
