"""Any model as the layers of a distributed pipeline, and tensors shared across stages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.prepared import prepare_model, shared_state
from tests.support.wrap_models import ResidualMLP


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


def test_shared_parameters_across_stages_are_refused() -> None:
    shared = nn.Linear(4, 4)
    layers = [shared, nn.ReLU(), nn.Linear(4, 4)]
    layers[2].weight = shared.weight
    assert shared_state(layers, [1, 2]) is not None
    assert shared_state(layers, [3]) is None
