"""Tests of ``autopipe profile`` (autopipe.cli.profile_command)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import autopipe
from autopipe.planning.planner import default_chunks
from profiler.profile import Profile
from tests.support.cli_support import (
    FAST,
    MLP,
    RESIDUAL_MODEL,
    assert_error,
    run,
)


def test_profile_command(profile_file: Path) -> None:
    profile = Profile.load(profile_file)
    assert len(profile) == 16
    assert profile.names[0] == "embed" and profile.layers[0].kind == "Linear"
    assert profile.batch_size == 32 and profile.chunks == 8
    assert profile.batch_sizes == [2, 4]


def test_profile_with_autocast_and_dtype(
    capsys: pytest.CaptureFixture[str], profile_file: Path, tmp_path: Path
) -> None:
    out_file = tmp_path / "bf16.json"
    argv = ["profile", MLP, "-o", str(out_file), "--autocast", "bfloat16", "--dtype", "bfloat16"]
    code, out, err = run(capsys, *argv, *FAST)
    assert code == 0, err
    assert "(dtype bfloat16, autocast bfloat16)" in out
    half, full = Profile.load(out_file), Profile.load(profile_file)
    assert (half.autocast, half.dtype) == ("bfloat16", "bfloat16")
    assert (full.autocast, full.dtype) == (None, "float32")
    assert [2 * layer.param_bytes for layer in half.layers] == [
        layer.param_bytes for layer in full.layers
    ]
    assert half.input == [n // 2 for n in full.input]  # the sample is cast too
    code, out, err = run(capsys, "plan", "--profile", str(out_file))
    assert code == 0, err
    assert "optimizer adam, dtype bfloat16, autocast bfloat16" in out
    argv = ["plan", "--profile", str(out_file), "--autocast", "bfloat16", "--dtype", "bfloat16"]
    assert run(capsys, *argv)[0] == 0
    argv = ["plan", "--profile", str(out_file), "--autocast", "float16"]
    assert_error(*run(capsys, *argv), "profiled with autocast bfloat16, not --autocast float16")
    argv = ["plan", "--profile", str(profile_file), "--dtype", "bfloat16", "--search"]
    assert_error(*run(capsys, *argv), "profiled with dtype float32, not --dtype bfloat16")


def test_wrap_takes_the_profile_of_autopipe_profile(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "residual.py"
    path.write_text(RESIDUAL_MODEL)
    profile_path = tmp_path / "residual.json"
    assert run(capsys, "profile", str(path), "-o", str(profile_path), *FAST)[0] == 0
    from autopipe.cli.model_file import load_model_file

    loaded = load_model_file(path)
    reference = copy.deepcopy(loaded.model)
    profile = Profile.load(profile_path)
    wrapped = autopipe.wrap(loaded.model, loaded.sample, stages=2, profile=profile)
    try:
        assert wrapped.plan.chunks == profile.chunks == default_chunks(2, 8)
        assert sum(wrapped.plan.balance) == 6
        expected = torch.cat([reference(part) for part in loaded.sample.tensor_split(4)])
        torch.testing.assert_close(wrapped(loaded.sample), expected)
    finally:
        wrapped.close()
