"""Tests of ``autopipe calibrate`` (autopipe.cli.calibrate_command)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autopipe
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.plans import Plan
from profiler.fit import segments
from profiler.profile import Profile
from tests.support.cli_support import FAST, MLP, SMALL_MODEL, assert_error, run


def test_calibrate(capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path) -> None:
    out_file = tmp_path / "calibrated.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--repeats", "2"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "executor overhead" in out and "copies at" in out
    calibration = Profile.load(out_file).meta["calibration"]
    assert calibration["overhead_s"] >= 0 and calibration["bandwidth"] > 0
    plan_file = tmp_path / "plan.json"
    code, _, err = run(capsys, "plan", "--profile", str(out_file), "--json", str(plan_file))
    assert code == 0, err
    result = Plan.load(plan_file)
    assert result.devices[0].bandwidth == pytest.approx(calibration["bandwidth"])
    assert result.stages[0].overhead == pytest.approx(calibration["overhead_s"])


def test_calibrate_with_the_model_scales_compute(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "calibrated.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--repeats", "2", "--model", MLP]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "in a whole step layers run" in out
    calibration = Profile.load(out_file).meta["calibration"]
    assert calibration["compute_scale"] > 0 and calibration["fixed_scale"] > 0
    plain = autopipe.plan(Profile.load(profile_file), 2)
    scaled = autopipe.plan(Profile.load(out_file), 2, overhead=0.0, bandwidth=1e30)
    # Each layer time a + b·size becomes fixed_scale·a + compute_scale·b·size. (A ratio of
    # totals need not lie between the two scales: a segment's a can be negative.)
    size = plain.batch_size / plain.chunks
    base = ProfileLines.from_profile(Profile.load(profile_file))
    lines = ProfileLines.from_profile(Profile.load(out_file))
    for figure in ("forward", "backward"):
        a, b = segments(base.sizes, base.values[figure], size)
        expected = np.maximum(
            calibration["fixed_scale"] * a + calibration["compute_scale"] * b * size, 0.0
        )
        np.testing.assert_allclose(lines.figure(figure, size), expected, rtol=1e-9)
    forward = lines.figure("forward", size).sum()
    assert sum(s.forward for s in scaled.stages) == pytest.approx(forward, rel=1e-9)
    other = tmp_path / "other.py"
    other.write_text(SMALL_MODEL)
    argv = ["calibrate", str(profile_file), "-o", str(tmp_path / "x.json"), "--model", str(other)]
    assert_error(*run(capsys, *argv), "pass the model file the profile was made from")
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ("nope", "--devices 'nope' is not a device"),
        ("", "--devices lists no devices"),
        (" , ", "--devices lists no devices"),
        ("cpu,", "--devices 'cpu,' has an empty entry"),
        ("cpu,meta", "--devices meta: meta tensors hold no data"),
    ],
)
def test_calibrate_bad_devices(
    capsys: pytest.CaptureFixture[str],
    profile_file: Path,
    tmp_path: Path,
    devices: str,
    expected: str,
) -> None:
    out_file = tmp_path / "x.json"
    argv = ["calibrate", str(profile_file), "-o", str(out_file), "--devices", devices]
    assert_error(*run(capsys, *argv), expected)
    assert not out_file.exists()


def test_calibrate_casts_the_model_as_profiled(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autopipe.gpipe import executor_calibration as calibration

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    measure = calibration.measure_compute_scale

    def recording(
        model: torch.nn.Sequential, sample: torch.Tensor, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        seen.append((next(model.parameters()).dtype, sample.dtype))
        return measure(model, sample, *args, **kwargs)

    monkeypatch.setattr(calibration, "measure_compute_scale", recording)
    path = tmp_path / "good.py"
    path.write_text(SMALL_MODEL)
    profile_path = tmp_path / "profile.json"
    argv = ["profile", str(path), "-o", str(profile_path), "--dtype", "bfloat16"]
    assert run(capsys, *argv, "--autocast", "bfloat16", *FAST)[0] == 0
    argv = ["calibrate", str(profile_path), "--model", str(path), "--repeats", "1"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "in a whole step layers run" in out
    assert seen == [(torch.bfloat16, torch.bfloat16)]
