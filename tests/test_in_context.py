"""Tests of timing a whole training step against the profile (profiler.in_context)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiler import profile_model
from profiler.in_context import measure_compute_scale, predicted_compute
from tests.planning_cases import linear_profile


def test_predicted_compute_sums_layers_and_micro_batches() -> None:
    # Forward t and backward 2t at 8 samples, proportional to the size.
    profile = linear_profile([1.0, 2.0], batch=8)
    assert predicted_compute(profile, [4, 4, 3]) == pytest.approx((3.0 + 6.0) * 11 / 8)


def test_scale_is_the_ratio_of_a_measured_step_to_the_profile() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    sample = torch.randn(16, 32)
    profile = profile_model(model, sample, chunks=4, warmup=1, repeats=3)
    before = [p.detach().clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    result = measure_compute_scale(model, sample, profile, repeats=3, warmup=1)
    assert result["step_s"] > 0 and result["predicted_s"] > 0
    assert result["compute_scale"] == pytest.approx(result["step_s"] / result["predicted_s"])
    # The model is left as it was: no gradients, same weights, same RNG.
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(rng, torch.get_rng_state())


def test_tuple_sample_and_mismatched_model() -> None:
    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a * b

    model = nn.Sequential(Pair(), nn.Linear(4, 2))
    sample = (torch.randn(8, 4), torch.randn(8, 4))
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1)
    assert measure_compute_scale(model, sample, profile, repeats=1)["compute_scale"] > 0
    with pytest.raises(ValueError, match="the profile has 2 layers but the model has 1"):
        measure_compute_scale(nn.Sequential(nn.Linear(4, 2)), sample, profile)
