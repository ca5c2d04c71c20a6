"""Tests of the defaults and option values the commands share (autopipe.cli.options)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopipe.cli import options
from autopipe.planning.planner import default_chunks
from tests.support.cli_support import FAST, MLP, SMALL_MODEL, assert_error, run


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_chunks(2, 32) == 8
    assert default_chunks(4, 8) == 4  # micro-batches of 2: batch norm cannot train on 1
    assert default_chunks(2, 3) == 1
    assert default_chunks(3, 1) == 1
    monkeypatch.setattr(options, "_gpu_count", lambda: 0)
    assert options.default_stages() == 2 and options.default_device() == "cpu"
    monkeypatch.setattr(options, "_gpu_count", lambda: 1)
    assert options.default_stages() == 2 and options.default_device() == "cuda:0"
    monkeypatch.setattr(options, "_gpu_count", lambda: 8)
    assert options.default_stages() == 8


def test_unwritable_outputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, profile_file: Path
) -> None:
    missing_dir = tmp_path / "no" / "such" / "plan.json"
    argv = ["plan", "--profile", str(profile_file), "--json", str(missing_dir)]
    assert_error(*run(capsys, *argv), "does not exist")
    argv = ["plan", "--profile", str(profile_file), "--json", str(tmp_path)]
    assert_error(*run(capsys, *argv), "is a directory")
    assert_error(*run(capsys, "profile", MLP, "-o", str(missing_dir), *FAST), "does not exist")
    assert not missing_dir.parent.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_device(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.py"
    path.write_text(SMALL_MODEL)
    argv = ["plan", str(path), "--device", "cuda:0", *FAST]
    assert_error(*run(capsys, *argv), "CUDA is not available")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", MLP, "--autocast", "fp8"], "--autocast must be bfloat16 or float16, got 'fp8'"),
        (["plan", MLP, "--autocast", "float32"], "--autocast must be bfloat16 or float16"),
        (["plan", MLP, "--dtype", "int8"], "--dtype must be float32, bfloat16 or float16"),
        (["plan", MLP, "--search", "--autocast", "half"], "--autocast must be"),
        (["profile", MLP, "--dtype", "float64"], "got 'float64'"),
        (["profile", MLP, "--autocast", "bf16"], "got 'bf16'"),
    ],
)
def test_bad_precision_options(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], expected: str
) -> None:
    out_file = tmp_path / "out.json"
    option = "-o" if argv[0] == "profile" else "--json"
    assert_error(*run(capsys, *argv, option, str(out_file)), expected)
    assert not out_file.exists()
    code, out, _ = run(capsys, argv[0], "--help")
    assert code == 0 and "--autocast {bfloat16,float16}" in out
    assert "--dtype {float32,bfloat16,float16}" in out


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("meta", "--device meta: meta tensors hold no data"),
        ("nonsense", "--device 'nonsense' is not a device: use cpu, cuda or cuda:N"),
        ("", "--device '' is not a device"),
        ("cuda:x", "--device 'cuda:x' is not a device"),
    ],
)
def test_device_is_checked_before_anything_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, device: str, expected: str
) -> None:
    # The model file would fail to import: the device is refused first.
    path = tmp_path / "raises.py"
    path.write_text("raise RuntimeError('imported')\n")
    out_file = tmp_path / "out.json"
    argv = ["plan", str(path), "--device", device, "--json", str(out_file)]
    assert_error(*run(capsys, *argv), expected)
    assert_error(*run(capsys, "profile", str(path), "--device", device, "-o", str(out_file)))
    assert not out_file.exists()
