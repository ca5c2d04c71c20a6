"""Checks of models run in float64, where a pipeline and the plain model agree to rounding."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree


def assert_close64(actual: Any, expected: Any) -> None:
    """Equal to float64 rounding (relative 1e-9, absolute 1e-10)."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-10)


def square_loss(output: Any) -> Tensor:
    """The sum of squares of every floating-point tensor in ``output`` (any nesting)."""
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
    return sum((t.square().sum() for t in leaves if t.is_floating_point()), torch.zeros(()))
