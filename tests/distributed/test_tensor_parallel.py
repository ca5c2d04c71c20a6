"""Tensor parallelism inside the stages: K·t gloo ranks train a tiny Llama as one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopipe.distributed.replicas import check_layout
from autopipe.distributed.tensor_parallel import _matches, tensor_parallel_problem
from autopipe.graph import model_tp_plan
from tests.support.dist_workers import scenario_results
from tests.support.tp_workers import RUNS, tiny_llama

# float64 throughout (norms included, tests.support.tp_workers.RMSNorm64): the all-reduces
# only reorder sums, so losses and parameters agree to float64 rounding.
TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}


def test_refusals() -> None:
    model = tiny_llama()
    assert "model.layers.*.self_attn.q_proj" in (model_tp_plan(model) or {})
    assert _matches("model.layers.*.mlp.up_proj", "model.layers.1.mlp.up_proj")
    problem = tensor_parallel_problem(model, 2, {"lm_head": "diagonal"}, "1f1b", 1)
    assert problem is not None and "unknown tensor-parallel style 'diagonal'" in problem
    odd = tiny_llama(heads=3, kv_heads=3, hidden=48)
    problem = tensor_parallel_problem(odd, 2, None, "1f1b", 1)
    assert problem is not None and "num_attention_heads=3 is not divisible" in problem
    assert tensor_parallel_problem(model, 2, None, "1f1b", 1) is None
    with pytest.raises(ValueError, match="not K·t·D"):
        check_layout(6, 2, 2, None, 2)
    assert check_layout(8, 2, 2, None, 2) == 2


@pytest.mark.parametrize("world", [2, 4])
def test_trains_as_the_plain_model(world: int, tmp_path: Any) -> None:
    results = scenario_results("tensor-parallel", world, tmp_path, limit=300)
    reference = results[0]["reference"]
    for index, layout in enumerate(RUNS[world]):
        runs = [result["runs"][index] for result in results]
        assert all(run["layout"] == layout for run in runs)
        losses = [run["losses"] for run in runs if run["losses"][0] is not None]
        assert len(losses) == layout[1] * (world // (layout[0] * layout[1]))
        for mine in losses:
            torch.testing.assert_close(torch.stack(mine), torch.stack(reference["losses"]),
                                       **TOLERANCE)  # fmt: skip
        state = runs[0]["state"]
        assert list(state) == list(reference["state"])
        for key, value in state.items():
            assert value.shape == reference["state"][key].shape  # whole, not a shard
            torch.testing.assert_close(value, reference["state"][key], **TOLERANCE)
        if layout[1] > 1:  # gradients land in their parameters' placements
            assert runs[0]["placements"]
            assert all(p == g for p, g in runs[0]["placements"].values())
    for result in results:
        assert "unknown tensor-parallel style 'diagonal'" in result["refused"]
