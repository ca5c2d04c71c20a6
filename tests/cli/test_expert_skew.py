"""``--expert-skew S``: the routing counted for mixtures of experts, and meta MoE models
of each family planned for a catalog device."""

from __future__ import annotations

from pathlib import Path

import pytest

from profiler.profile import Profile
from tests.support.cli_support import (
    SMALL_MODEL,
    assert_error,
    counted_profiles,
    plan_after_change,
    run,
)

# A small model of one family (tests.support.moe_models), on the meta device in bfloat16.
MOE_MODEL = """
import torch
from tests.support.moe_models import FAMILIES

def model():
    build, _ = FAMILIES[{family!r}]
    with torch.device("meta"):
        return build().to(torch.bfloat16)

def sample():
    return torch.zeros(4, 8, dtype=torch.long)
"""


def _moe_file(folder: Path, family: str) -> Path:
    path = folder / f"{family}.py"
    path.write_text(MOE_MODEL.format(family=family))
    return path


@pytest.mark.parametrize(
    ("family", "experts", "moe_layers"),
    [("mixtral", 4, 2), ("qwen2_moe", 4, 2), ("deepseek_v3", 8, 2)],  # DeepSeek: 1 dense first
)
def test_meta_moe_models_plan_for_a_target_with_their_experts_counted(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    family: str,
    experts: int,
    moe_layers: int,
) -> None:
    profiles = counted_profiles(capsys, monkeypatch, _moe_file(tmp_path, family))
    (profile,) = profiles
    routed = [layer for layer in profile.layers if layer.experts is not None]
    assert len(routed) == moe_layers
    for layer in routed:
        assert layer.experts is not None
        assert (layer.experts.experts, layer.experts.top_k, layer.experts.skew) == (
            experts,
            2,
            1.0,
        )
        # Every routed copy of the micro-batch's tokens: tokens * top_k rows, bfloat16.
        tokens = [size * 8 for size in profile.batch_sizes]
        assert layer.experts.dispatch_bytes == [t * 2 * 16 * 2 for t in tokens]
        assert layer.flops is not None
        assert all(e < f for e, f in zip(layer.experts.flops, layer.flops, strict=True))


def test_the_skew_is_counted_and_recorded(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _moe_file(tmp_path, "mixtral")
    (balanced,) = counted_profiles(capsys, monkeypatch, path)
    (skewed,) = counted_profiles(capsys, monkeypatch, path, "--expert-skew", "1.5")
    for ours, theirs in zip(skewed.layers, balanced.layers, strict=True):
        if theirs.experts is None:
            assert ours.experts is None
            continue
        assert ours.experts is not None
        assert ours.experts.skew == 1.5
        assert ours.experts.flops == theirs.experts.flops


@pytest.mark.parametrize("value", ["0.5", "0", "-2", "abc", "inf", "nan"])
@pytest.mark.parametrize("command", ["plan", "profile"])
def test_a_bad_skew_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, command: str
) -> None:
    path = tmp_path / "small.py"
    path.write_text(SMALL_MODEL)
    extra = ["-o", str(tmp_path / "out.json")] if command == "profile" else []
    code, out, err = run(capsys, command, str(path), *extra, "--expert-skew", value)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "argument --expert-skew: expected a number >= 1" in lines[0]
    assert repr(value) in lines[0]


def test_the_skew_is_part_of_the_cache_key(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "small.py"
    path.write_text(SMALL_MODEL)
    changed, again = plan_after_change(capsys, path, None, "--expert-skew", "2")
    assert "profile: cached" not in changed
    assert "profile: cached" in again


def test_a_profile_counted_with_another_skew_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, profile_file: Path
) -> None:
    profile = Profile.load(str(profile_file))
    n = len(profile.batch_sizes)
    saved = tmp_path / "skewed.json"
    record = profile.to_dict()
    record["layers"][0]["experts"] = {
        "experts": 4,
        "top_k": 2,
        "blocks": 1,
        "param_bytes": 0,
        "flops": [0.0] * n,
        "backward_flops": [0.0] * n,
        "backward_input_flops": [0.0] * n,
        "saved": [0] * n,
        "dispatch_bytes": [0] * n,
        "skew": 1.0,
    }
    Profile.from_dict(record).save(str(saved))
    code, out, err = run(capsys, "plan", "--profile", str(saved), "--expert-skew", "2")
    assert_error(code, out, err, "was counted with expert skew 1, not --expert-skew 2")
    code, out, err = run(capsys, "plan", "--profile", str(saved), "--expert-skew", "1")
    assert code == 0, err


def test_experts_in_the_eager_loop_are_refused_with_the_kernel_that_traces(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "eager.py"
    path.write_text(
        MOE_MODEL.format(family="mixtral").replace(
            "build().to(torch.bfloat16)", "build(experts_implementation='eager').to(torch.bfloat16)"
        )
    )
    code, out, err = run(capsys, "plan", str(path), "--target", "h100", "--no-cache")
    assert_error(code, out, err, "the experts of MixtralExperts (model.layers.0.mlp.experts")
    assert "run Hugging Face's eager per-expert loop" in err
    assert "model.set_experts_implementation('grouped_mm')" in err
