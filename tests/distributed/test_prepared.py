"""Any model as the layers of a distributed pipeline."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.prepared import prepare_model
from tests.support.dist_workers import scenario_results
from tests.support.moe_runner_models import DIST_CASES, Routed, plain_steps
from tests.support.wrap_models import ResidualMLP

_moe_reference = functools.cache(plain_steps)


def test_non_sequential_models_are_wrapped_or_rejected() -> None:
    model = ResidualMLP()
    x = torch.randn(4, 5)
    prepared = prepare_model(model, x)
    assert prepared.wrapped and len(prepared.sequential) == 6
    value: Any = prepared.flatten(x)
    for unit in prepared.sequential:
        value = unit(value)
    torch.testing.assert_close(prepared.rebuild(value, True), model(x))
    with pytest.raises(ValueError, match="pass an nn.Sequential"):
        prepare_model(nn.Linear(2, 2), [x])


def test_outputs_computed_per_micro_batch_are_named() -> None:
    model = Routed()
    prepared = prepare_model(model, torch.randn(4, 5, 6))
    assert prepared.per_micro_batch == ("['aux']",)  # not the router logits: per token


def test_mixtures_of_experts_train_as_the_plain_model(tmp_path: Any) -> None:
    """Tiny Mixtral and Qwen2-MoE on 2 gloo ranks, experts replicated inside their stage:
    3 SGD steps' losses and parameters equal the plain model's (float64); with the router
    loss in the trained loss, the plain model's on the same micro-batches."""
    pytest.importorskip("transformers")
    results = scenario_results("moe", 2, tmp_path, limit=600)
    for index, (kind, router_logits, schedule) in enumerate(DIST_CASES):
        key = f"{kind} router_logits={router_logits} {schedule}"
        reference = _moe_reference(kind, router_logits)["steps"]
        ranks = [result["cases"][index] for result in results]
        assert ranks[0]["balance"] == ranks[1]["balance"] and len(ranks[0]["balance"]) == 2
        for step, expected in enumerate(reference):
            assert ranks[0]["steps"][step]["loss"] is None, key  # the last rank's loss
            loss = ranks[1]["steps"][step]["loss"]
            torch.testing.assert_close(loss, expected["loss"], rtol=1e-9, atol=1e-12, msg=key)
            held = [rank["steps"][step]["params"] for rank in ranks]
            assert held[0].keys().isdisjoint(held[1]), key  # each expert on one stage only
            assert held[0].keys() | held[1].keys() == expected["params"].keys(), key
            for name, value in {**held[0], **held[1]}.items():
                want = expected["params"][name]
                torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-12, msg=name)
    without = _moe_reference("mixtral", False)["steps"][0]["loss"]
    assert abs(_moe_reference("mixtral", True)["steps"][0]["loss"] - without) > 1e-3
    for result in results:
        assert "outputs ['aux'] are computed from whole micro-batches" in result["refused"]
