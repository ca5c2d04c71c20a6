"""Sharded replicas (ZeRO-2/3): K·D gloo ranks, each stage fully_shard-ed over its D replicas."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopipe.distributed.sharded_replicas import resolve_zero, zero_problem
from autopipe.planning import Mesh
from tests.support.dist_workers import scenario_results
from tests.support.zero_workers import REPLICAS, RUNS

# float64 throughout: reduce-scatters and all-gathers only reorder sums.
TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}


class _Plan:
    mesh = Mesh(zero=3)


def test_zero_checks() -> None:
    assert resolve_zero(None, None) == 0
    assert resolve_zero(None, _Plan()) == 3
    assert resolve_zero(2, _Plan()) == 2
    assert zero_problem(3, 2, 1) is None
    assert "zero must be one of 0, 1, 2, 3" in str(zero_problem(4, 2, 1))
    assert "zero must be one of" in str(zero_problem(True, 2, 1))
    assert "tensor_parallel=2" in str(zero_problem(2, 2, 2))


@pytest.mark.parametrize("world", [2, 4])
def test_trains_as_the_plain_model(world: int, tmp_path: Any) -> None:
    results = scenario_results("zero", world, tmp_path, limit=400)
    stages = world // REPLICAS
    for index, (name, _, zero, _) in enumerate(RUNS[world]):
        reference = results[0]["reference"][name]
        runs = [result["runs"][index] for result in results]
        assert all(run["zero"] == zero for run in runs)
        last = [run for run in runs if run["stage"] == stages - 1]
        assert len(last) == REPLICAS
        for run in last:
            torch.testing.assert_close(torch.stack(run["losses"]),
                                       torch.stack(reference["losses"]), **TOLERANCE)  # fmt: skip
        for rank, run in enumerate(runs):
            # Each rank holds 1/D of every parameter of its stage (dim 0, padded).
            assert run["sharded"] and run["local"], (name, zero, rank)
            for param, numel in run["local"].items():
                full = run["whole"][param]
                assert numel < full and numel * REPLICAS >= full, (param, numel, full)
            assert sum(run["local"].values()) * REPLICAS < 1.5 * sum(run["whole"].values())
            for key, value in run["own state"].items():  # whole tensors, the plain model's
                torch.testing.assert_close(value, reference["state"][key], **TOLERANCE)
        state = runs[0]["state"]
        assert list(state) == list(reference["state"])
        for key, value in state.items():
            assert value.shape == reference["state"][key].shape  # whole, not a shard
            torch.testing.assert_close(value, reference["state"][key], **TOLERANCE)
        assert all(run["state"] is None for run in runs[1:])
