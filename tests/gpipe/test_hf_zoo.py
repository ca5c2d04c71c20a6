"""Hugging Face architectures with their default configs, wrapped into two stages."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from autopipe.gpipe.wrapping import wrap

transformers = pytest.importorskip("transformers")
from tests.support.hf_models import ZOO  # noqa: E402

pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype


def _tensors(output: Any) -> dict[str, Tensor]:
    """The output's tensors by key; the cache is left out (the pipeline traces without)."""
    items = output.items() if isinstance(output, dict) else enumerate(pytree.tree_leaves(output))
    found = {}
    for key, value in items:
        if key == "past_key_values":
            continue
        for i, leaf in enumerate(pytree.tree_leaves(value)):
            if isinstance(leaf, Tensor):
                found[f"{key}.{i}"] = leaf
    return found


# Mamba's reference scan runs in float32 whatever the model's dtype.
_TOLERANCE = {"mamba": {"rtol": 1e-5, "atol": 1e-6}}


@pytest.mark.parametrize("name", list(ZOO))
def test_default_config_trains_like_the_model(name: str) -> None:
    tolerance = _TOLERANCE.get(name, {"rtol": 1e-9, "atol": 1e-10})
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name]()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, args, kwargs=kwargs, stages=2, chunks=2)
    assert len(wrapped.plan.balance) == 2
    assert list(wrapped.state_dict()) == list(reference.state_dict())
    # Default dropout draws differ per micro-batch: compare in evaluation mode.
    wrapped.eval()
    reference.eval()
    ours, theirs = _tensors(wrapped(*args, **kwargs)), _tensors(reference(*args, **kwargs))
    assert ours.keys() == theirs.keys()
    torch.testing.assert_close(ours, theirs, **tolerance)
    sum(t.square().sum() for t in ours.values() if t.is_floating_point()).backward()
    sum(t.square().sum() for t in theirs.values() if t.is_floating_point()).backward()
    grads = dict(reference.named_parameters())
    for key, param in wrapped.named_parameters():
        expected = grads[key].grad
        if expected is None:
            assert param.grad is None, key
        else:
            assert param.grad is not None, key
            torch.testing.assert_close(param.grad, expected, **tolerance)
    wrapped.close()
