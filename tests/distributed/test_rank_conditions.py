"""Profiles timed on the ranks themselves, every rank at once, and merged into one."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from autopipe.distributed.rank_conditions import profile_on_local_ranks, with_rank_times
from profiler.measure import profile_model
from tests.support.planning_cases import linear_profile


def _rank(forward: list[list[float]], spread: float, threads: int = 1) -> dict:
    return {
        "forward": forward,
        "backward": [[2 * t for t in f] for f in forward],
        "backward_input": [None for _ in forward],
        "batch_sizes": [4, 8],
        "spread": spread,
        "threads": threads,
    }


def test_rank_times_are_the_mean_and_nothing_else_changes() -> None:
    profile = linear_profile([1.0, 2.0], saved=[16, 32], output=[8, 8], batch=8, chunks=1)
    first, second = _rank([[1.0, 2.0], [4.0, 8.0]], 0.1), _rank([[3.0, 4.0], [6.0, 8.0]], 0.3)
    merged = with_rank_times(profile, [first, second])
    assert [layer.forward for layer in merged.layers] == [[2.0, 3.0], [5.0, 8.0]]
    assert [layer.backward for layer in merged.layers] == [[4.0, 6.0], [10.0, 16.0]]
    assert [layer.saved for layer in merged.layers] == [layer.saved for layer in profile.layers]
    assert merged.meta["spread"] == pytest.approx(0.2)
    assert merged.meta["profiled_on_ranks"] == {"ranks": 2, "threads": [1, 1]}
    assert [layer.forward for layer in profile.layers] == [[0.5, 1.0], [1.0, 2.0]]  # as it was


def test_the_ranks_in_step_scales_are_averaged_into_the_calibration() -> None:
    profile = linear_profile([1.0, 2.0], batch=8, chunks=1)
    first, second = _rank([[1.0, 2.0], [4.0, 8.0]], 0.1), _rank([[1.0, 2.0], [4.0, 8.0]], 0.1)
    first["scales"], second["scales"] = [1.5, 1.25], [0.5, 0.75]
    merged = with_rank_times(profile, [first, second])
    assert merged.meta["calibration"] == {"fixed_scale": 1.0, "compute_scale": 1.0}
    second["scales"] = None  # a rank without them: none stored, rather than one rank's
    assert "calibration" not in with_rank_times(profile, [first, second]).meta


def test_other_layers_are_refused() -> None:
    profile = linear_profile([1.0, 2.0], batch=8, chunks=1)
    with pytest.raises(ValueError, match="profile again"):
        with_rank_times(profile, [_rank([[1.0, 2.0]], 0.0)])


def _tiny() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 8)


def test_two_ranks_profile_the_model_bound_as_they_run() -> None:
    build = functools.partial(_tiny)
    found = profile_on_local_ranks(build, 2, chunks=2, repeats=2, warmup=0, cuda=False)
    assert len(found) == 2
    layers, sample = _tiny()
    profile = profile_model(layers, sample, chunks=2, repeats=1, warmup=0)
    for rank in found:
        assert rank["batch_sizes"] == profile.batch_sizes
        assert len(rank["forward"]) == 3 and all(t > 0 for f in rank["forward"] for t in f)
        # Each rank computes with its own share of the CPUs' threads.
        assert 1 <= rank["threads"] <= max(1, torch.get_num_threads())
    merged = with_rank_times(profile, found)
    assert merged.meta["profiled_on_ranks"]["ranks"] == 2
    assert all(rank["scales"] is None for rank in found)  # not asked for


def test_two_ranks_fit_the_in_step_scales_together() -> None:
    found = profile_on_local_ranks(_tiny, 2, chunks=2, repeats=1, warmup=0, cuda=False, scale=True)
    for rank in found:
        fixed, per_sample = rank["scales"]
        assert fixed > 0 and per_sample > 0
