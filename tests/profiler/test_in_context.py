"""Tests of timing a whole training step against the profile (profiler.in_context)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiler import profile_model
from profiler.in_context import (
    _fit_scales,
    chunk_counts,
    measure_compute_scale,
)
from profiler.profile import LayerProfile, Profile
from tests.support.planning_cases import linear_profile


def test_scales_fit_the_measured_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    sample = torch.randn(16, 32)
    profile = profile_model(model, sample, chunks=4, warmup=1, repeats=3)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    result = measure_compute_scale(model, sample, profile, repeats=3, warmup=1)
    assert result["chunks"] == chunk_counts(16, 4) == [1, 2, 4, 8, 16]
    assert len(result["step_s"]) == len(result["predicted_s"]) == 5
    # predicted: Σ over the real micro-batches (even and uneven) and the layers.
    uneven = measure_compute_scale(model, sample, profile, chunks=[3, 5], repeats=1, warmup=0)
    for m, predicted in zip(
        [*result["chunks"], *uneven["chunks"]], [*result["predicted_s"], *uneven["predicted_s"]]
    ):
        sizes = [len(part) for part in sample.tensor_split(m)]
        figures = ("forward", "backward")
        total = sum(profile.predict(i, f, b) for b in sizes for i in range(3) for f in figures)
        assert predicted == pytest.approx(total)
    assert result["compute_scale"] > 0 and result["fixed_scale"] > 0
    # The model is left as it was: no gradients, same weights, same RNG.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def test_sync_runs_before_every_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    sample = torch.randn(8, 4)
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1)
    calls: list[int] = []
    result = measure_compute_scale(
        model, sample, profile, chunks=[1, 2], repeats=3, warmup=1, sync=lambda: calls.append(1)
    )
    assert len(calls) == (1 + 3) * 2 and len(result["step_s"]) == 2


class AutocastRecord(nn.Module):
    """Records the autocast dtype of every forward (in a module-level list: deepcopy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        on = torch.is_autocast_enabled("cpu")
        AUTOCAST_SEEN.append(torch.get_autocast_dtype("cpu") if on else None)
        return x


AUTOCAST_SEEN: list[torch.dtype | None] = []


def test_steps_run_under_the_profiles_autocast() -> None:
    model = nn.Sequential(nn.Linear(4, 4), AutocastRecord())
    sample = torch.randn(8, 4)
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1, autocast="bfloat16")
    AUTOCAST_SEEN.clear()
    measure_compute_scale(model, sample, profile, chunks=[1, 2], repeats=1, warmup=0)
    assert AUTOCAST_SEEN and set(AUTOCAST_SEEN) == {torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu")


def test_fit_recovers_known_scales() -> None:
    parts = [(1.0 * m, 4.0) for m in (1, 2, 4, 8)]
    measured = [2.0 * a + 0.5 * b for a, b in parts]
    assert _fit_scales(parts, measured) == pytest.approx((2.0, 0.5))
    # One count cannot tell the parts apart: both get the overall ratio.
    assert _fit_scales(parts[:1], [10.0]) == pytest.approx((2.0, 2.0))


def test_planner_scales_intercepts_and_slopes_apart() -> None:
    from autopipe.planning.planner import evaluate

    profile = linear_profile([1.0, 2.0], batch=8)
    base = evaluate(profile, [2], chunks=1, checkpoint="never").step_time
    profile.meta["calibration"] = {"compute_scale": 3.0}
    assert evaluate(profile, [2], chunks=1, checkpoint="never").step_time == pytest.approx(3 * base)
    # A layer of 1 s per micro-batch plus 0.25 s per sample, forward; backward free.
    layer = LayerProfile("l", "Linear", [1.5, 2.0], [0.0, 0.0], [0, 0], [0, 0])
    fixed = Profile(layers=[layer], batch_sizes=[2, 4], input=[0, 0], batch_size=4, chunks=1)
    fixed.meta["calibration"] = {"compute_scale": 3.0, "fixed_scale": 10.0}
    plan = evaluate(fixed, [1], chunks=2, checkpoint="never")
    assert plan.step_time == pytest.approx(2 * (10.0 * 1.0 + 3.0 * 0.25 * 2))


def test_tuple_sample_and_mismatched_model() -> None:
    class Pair(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] * pair[1]

    # nn.Sequential takes one input: here a tuple, which its first layer takes as one value.
    model = nn.Sequential(Pair(), nn.Linear(4, 2))
    sample = ((torch.randn(8, 4), torch.randn(8, 4)),)
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1)
    assert measure_compute_scale(model, sample, profile, repeats=1)["compute_scale"] > 0
    with pytest.raises(ValueError, match="the profile has 2 layers but the model has 1"):
        measure_compute_scale(nn.Sequential(nn.Linear(4, 2)), sample, profile)


def test_another_model_with_as_many_layers_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    profile = profile_model(model, torch.randn(4, 4), warmup=0, repeats=1)
    other = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with pytest.raises(ValueError, match=r"layer 1 is 1 \(Tanh\) in the model but 1 \(ReLU\)"):
        measure_compute_scale(other, torch.randn(4, 4), profile)


def test_scale_counts_are_the_chunks_and_half_of_them() -> None:
    from profiler.in_context import scale_counts

    assert scale_counts(8) == [4, 8]
    assert scale_counts(3) == [1, 3]
    assert scale_counts(1) == [1]


def test_calibrate_in_step_stores_the_fitted_scales() -> None:
    from profiler.in_context import calibrate_in_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    sample = torch.randn(8, 8)
    profile = profile_model(model, sample, chunks=4, repeats=1, warmup=0)
    found = calibrate_in_step(profile, model, sample, chunks=4, repeats=1, warmup=0)
    assert found["chunks"] == [2, 4]
    stored = profile.meta["calibration"]
    assert stored == {"fixed_scale": found["fixed_scale"], "compute_scale": found["compute_scale"]}
    assert stored["fixed_scale"] > 0 and stored["compute_scale"] > 0
