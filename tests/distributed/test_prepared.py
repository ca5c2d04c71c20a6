"""Any model as the layers of a distributed pipeline."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.prepared import prepare_model
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
