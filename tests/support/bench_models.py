"""Tiny models the step-benchmark tests build on every rank (picklable builders)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

WIDTH = 16
BATCH = 8


def build() -> tuple[nn.Sequential, Tensor]:
    """Four linear layers and one mini-batch."""
    torch.manual_seed(0)
    layers = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    return layers, torch.randn(BATCH, WIDTH)


def failing_build() -> tuple[nn.Sequential, Tensor]:
    """A model file that cannot be built."""
    raise ValueError("no model here")
