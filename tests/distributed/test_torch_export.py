"""torch's pipeline() split by an exported plan: the plan's parameters per stage, and a
training step on two gloo ranks equal to the plain model's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import pipeline

from autopipe.graph import prepare
from tests.support.export_cases import named_plan
from tests.support.export_models import MLP, Llama, stage_parameters
from tests.support.export_workers import (
    CHUNKS,
    make_llama,
    make_tokens,
    reference_step,
    run_ranks,
)


def _split_spec(text: str) -> dict[str, Any]:
    code: dict[str, Any] = {}
    exec(text, code)  # the snippet as a user pastes it
    return code["split_spec"]


@pytest.mark.parametrize(
    ("make", "balance", "virtual"),
    [
        (MLP, [4, 4, 2], 1),  # cuts inside blocks: before blocks.1.1 and blocks.3.1
        (Llama, [2, 3, 2], 1),
        (Llama, [2, 2, 1, 2], 2),  # 4 stages, 2 per rank
    ],
    ids=["mlp", "llama", "llama-virtual"],
)
def test_each_stage_holds_the_plans_parameters(make: Any, balance: list[int], virtual: int) -> None:
    torch.manual_seed(0)
    model: nn.Module = make()
    sample = torch.randn(4, 8) if make is MLP else make_tokens()[0][:2]
    names = prepare(model, sample).names
    plan = named_plan(names, balance, virtual)
    spec = _split_spec(plan.export("torch"))
    assert list(spec) == [stage.layers[0] for stage in plan.stages[1:]]
    pipe = pipeline(model, mb_args=(sample,), split_spec=spec)
    assert pipe.num_stages == plan.num_stages
    for k, stage in enumerate(plan.stages):
        held = {name for name, _ in pipe.get_stage_module(k).named_parameters()}
        assert held == stage_parameters(model, stage.layers), k


def _assert_trains_as_the_plain_model(
    tmp_path: Path, balance: list[int], virtual: int, runtime: str
) -> None:
    model = make_llama()
    names = prepare(model, make_tokens()[0][:2]).names
    plan = named_plan(names, balance, virtual)
    plan.save(tmp_path / "plan.json")
    results = run_ranks(2, tmp_path, runtime)
    loss, grads, after = reference_step(make_llama())
    torch.testing.assert_close(results[1]["loss"], loss, rtol=1e-5, atol=1e-6)
    assert results[0]["loss"] is None  # the last stage is rank 1's
    seen: set[str] = set()
    for rank, result in enumerate(results):
        for k, held in result["stages"].items():
            assert k % 2 == rank and set(held) == stage_parameters(model, plan.stages[k].layers)
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(result["params"][name], after[name], msg=name)
        seen |= set(result["grads"])
    assert seen == set(grads) and CHUNKS == 4  # every parameter trained, on one rank


@pytest.mark.parametrize(("balance", "virtual"), [([3, 4], 1), ([2, 2, 1, 2], 2)])
def test_a_training_step_on_two_ranks_equals_the_plain_model(
    tmp_path: Path, balance: list[int], virtual: int
) -> None:
    _assert_trains_as_the_plain_model(tmp_path, balance, virtual, "torch")


@pytest.mark.parametrize(("balance", "virtual"), [([3, 4], 1), ([2, 2, 1, 2], 2)])
def test_torchtitans_stages_train_as_the_plain_model(
    tmp_path: Path, balance: list[int], virtual: int
) -> None:
    # torchtitan installs beside this torch with --no-deps (and spmd_types, tyro,
    # docstring_parser); pipeline_llm builds its stages with this function.
    pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    _assert_trains_as_the_plain_model(tmp_path, balance, virtual, "torchtitan")


def _llama_plan(balance: list[int], virtual: int = 1) -> Any:
    model = make_llama()
    return model, named_plan(prepare(model, make_tokens()[0][:2]).names, balance, virtual)


@pytest.mark.parametrize(("balance", "virtual"), [([2, 3, 2], 1), ([2, 2, 1, 2], 2)])
def test_torchtitan_parts_cover_every_parameter_once_in_model_order(
    balance: list[int], virtual: int
) -> None:
    model, plan = _llama_plan(balance, virtual)
    parts = json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"]
    assert len(parts) == plan.num_stages
    covered = [
        f"{fqn}.{name}"
        for part in parts
        for fqn in part
        for name, _ in model.get_submodule(fqn).named_parameters()
    ]
    assert covered == [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize(("balance", "virtual"), [([2, 3, 2], 1), ([2, 2, 1, 2], 2)])
def test_torchtitans_splitter_keeps_the_plans_parameters(balance: list[int], virtual: int) -> None:
    # torchtitan installs beside this torch with --no-deps (and spmd_types, tyro,
    # docstring_parser); its splitter is the function pipeline_llm builds stages with.
    splitter = pytest.importorskip("torchtitan.distributed.pipeline_parallel")
    model, plan = _llama_plan(balance, virtual)
    parts = json.loads(plan.export("torchtitan-json"))["module_fqns_per_model_part"]
    tokens = make_tokens()[0]
    hidden = tokens
    for k, part in enumerate(parts):
        chunk = splitter._split_module(model, part)
        held = {name for name, _ in chunk.named_parameters()}
        assert held == stage_parameters(model, plan.stages[k].layers), k
        # Each part runs on its own: the stages in order compute the whole model.
        hidden = chunk(hidden)
    torch.testing.assert_close(hidden, model(tokens))
