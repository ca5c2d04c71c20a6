"""Mixtures of experts (tiny Mixtral, Qwen2-MoE and Qwen3-MoE, real top-2 routing) train
through ``wrap`` as the plain model does: experts replicated inside their stage, float64 and
SGD so that losses and parameters agree to rounding."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

from autopipe.gpipe.wrapping import wrap

pytest.importorskip("transformers")
from tests.support.moe_runner_models import (
    CHUNKS,
    LR,
    STEPS,
    labels_loss,
    lm_loss,
    moe_batch,
    moe_model,
    plain_steps,
)

_reference = functools.cache(plain_steps)


def _exact(actual: Tensor, expected: Tensor, name: str) -> None:
    """float64 equality up to the order of a few additions (micro-batches, stages)."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, msg=name)


def _train_and_compare(wrapped: Any, loss: Callable[[], Tensor], reference: dict[str, Any]) -> None:
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=LR)
    for step, expected in zip(range(STEPS), reference["steps"], strict=True):
        value = loss()
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
        _exact(value.detach(), expected["loss"], f"step {step} loss")
        params = dict(wrapped.named_parameters())
        assert params.keys() == expected["params"].keys()
        for name, param in params.items():
            _exact(param.detach(), expected["params"][name], f"step {step} {name}")
    wrapped.close()


# Qwen3-MoE's sparse blocks are Qwen2-MoE's without the shared expert: 2 stages suffice.
_CASES = [("mixtral", 2), ("mixtral", 4), ("qwen2-moe", 2), ("qwen2-moe", 4), ("qwen3-moe", 2)]


@pytest.mark.parametrize(("kind", "stages"), _CASES)
def test_a_mixture_of_experts_trains_as_the_plain_model(kind: str, stages: int) -> None:
    model, (ids, target) = moe_model(kind), moe_batch()
    wrapped = wrap(model, (ids,), stages=stages, chunks=CHUNKS)
    assert len(wrapped.plan.balance) == stages and sum(wrapped.plan.balance) == 8
    # The routed layers' experts stay whole inside their stage, under the model's names.
    assert "model.layers.3.mlp.experts.gate_up_proj" in dict(wrapped.named_parameters())
    _train_and_compare(wrapped, lambda: lm_loss(wrapped(ids), target), _reference(kind, False))


def test_the_router_loss_the_model_adds_is_trained_per_micro_batch() -> None:
    """``output_router_logits=True`` and labels: the model's ``loss`` adds its weighted
    load-balancing loss; the wrapped model's is the mean of that loss over the
    micro-batches, each from its own tokens, as the plain model computes it on them."""
    model, (ids, _) = moe_model("mixtral", router_logits=True), moe_batch()
    # Said once, where the pipeline is made: the router loss is the micro-batches' own.
    with pytest.warns(UserWarning, match=r"\(aux_loss, loss\) are computed on each of the"):
        wrapped = wrap(model, (ids,), kwargs={"labels": ids}, stages=2, chunks=CHUNKS)
    output = wrapped(ids, labels=ids)
    plain = moe_model("mixtral", router_logits=True)
    parts = [plain(x, labels=x) for x in ids.tensor_split(CHUNKS)]
    _exact(output.aux_loss, torch.stack([p.aux_loss for p in parts]).mean(), "aux_loss")
    # One (tokens, experts) tensor per layer, the micro-batches' rows joined in order.
    whole = plain(ids)
    assert len(output.router_logits) == 4
    for mine, theirs in zip(output.router_logits, whole.router_logits, strict=True):
        _exact(mine, theirs, "router logits")
    # The loss is the cross-entropy plus router_aux_loss_coef (0.001) times the router
    # loss (about 2 here). The model computes its loss in float32: compare to float32's
    # rounding, 1000 times finer than the router loss's part.
    logits = output.logits[:, :-1].reshape(-1, output.logits.shape[-1])
    entropy = torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1))
    expected = (entropy + 0.001 * output.aux_loss).float()
    torch.testing.assert_close(output.loss, expected, rtol=1e-6, atol=0)
    assert output.aux_loss > 1
    reference = _reference("mixtral", True, True)
    _train_and_compare(wrapped, lambda: labels_loss(wrapped(ids, labels=ids), ids), reference)
