"""Tensor parallelism inside the stages: K·t gloo ranks train a tiny Llama as one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from autopipe.distributed.replicas import check_layout
from autopipe.distributed.tensor_parallel import placed_styles, tensor_parallel_problem
from autopipe.graph import model_tp_plan, module_styles, shard_styles
from tests.support.dist_workers import scenario_results
from tests.support.tp_workers import RUNS, tiny_llama

# float64 throughout (norms included, tests.support.tp_workers.RMSNorm64): the all-reduces
# only reorder sums, so losses and parameters agree to float64 rounding.
TOLERANCE = {"rtol": 1e-12, "atol": 1e-12}


def test_refusals() -> None:
    model = tiny_llama()
    assert "model.layers.*.self_attn.q_proj" in (model_tp_plan(model) or {})
    problem = tensor_parallel_problem(model, 2, {"lm_head": "diagonal"}, "1f1b", 1)
    assert problem is not None and "the unknown style 'diagonal'" in problem
    problem = tensor_parallel_problem(model, 2, {"lm_head": "packed_colwise"}, "1f1b", 1)
    assert problem is not None and "cannot place the tensor-parallel style" in problem
    odd = tiny_llama(heads=3, kv_heads=3, hidden=48)
    problem = tensor_parallel_problem(odd, 2, None, "1f1b", 1)
    assert problem == (
        "model.layers.0.self_attn.q_proj has num_attention_heads=3, which tensor_parallel=2 "
        "cannot split into whole heads per rank; use a degree dividing 3 (1, 3)"
    )
    assert tensor_parallel_problem(model, 2, None, "1f1b", 1) is None
    # Key/value heads t cannot split are no refusal: their projections run replicated.
    assert tensor_parallel_problem(tiny_llama(kv_heads=1), 2, None, "1f1b", 1) is None
    with pytest.raises(ValueError, match="not K·t·D"):
        check_layout(6, 2, 2, None, 2)
    assert check_layout(8, 2, 2, None, 2) == 2


def test_key_value_projections_replicate_when_t_cannot_split_their_heads() -> None:
    model = tiny_llama(kv_heads=1)
    plan = model_tp_plan(model) or {}
    styles = placed_styles(model, plan, 2)
    assert styles["model.layers.0.self_attn.k_proj"] == "replicate"
    assert styles["model.layers.1.self_attn.v_proj"] == "replicate"
    assert styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert placed_styles(model, plan, 1) == module_styles(model, plan)


def _config(kind: str) -> Any:
    sizes = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "max_position_embeddings": 16,
    }
    return getattr(transformers, kind)(**sizes)


@pytest.mark.parametrize(
    ("config", "model"), [("LlamaConfig", "LlamaForCausalLM"), ("Qwen2Config", "Qwen2ForCausalLM")]
)
def test_the_runner_styles_every_module_as_the_counter(config: str, model: str) -> None:
    torch.manual_seed(0)
    net = getattr(transformers, model)(_config(config))
    plan = model_tp_plan(net)
    assert plan
    runner = placed_styles(net, plan, 2)
    # The counter's styles, parameter by parameter (the whole model as one layer).
    (counted,) = shard_styles(net, [net]) or [{}]
    for name, _ in net.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        assert runner.get(owner) == counted.get(name), name
    assert runner["model.layers.1.mlp.down_proj"] == "rowwise"
    assert runner["model.layers.0.self_attn.k_proj"] == "colwise"


@pytest.mark.parametrize("world", [2, 4])
def test_trains_as_the_plain_model(world: int, tmp_path: Any) -> None:
    results = scenario_results("tensor-parallel", world, tmp_path, limit=300)
    for index, layout in enumerate(RUNS[world]):
        reference = results[0]["reference"][layout[2]]
        runs = [result["runs"][index] for result in results]
        assert all(run["layout"] == layout for run in runs)
        losses = [run["losses"] for run in runs if run["losses"][0] is not None]
        assert len(losses) == layout[1] * (world // (layout[0] * layout[1]))  # t·D last ranks
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
        assert "the unknown style 'diagonal'" in result["refused"]
