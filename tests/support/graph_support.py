"""Building a model's layout in the graph tests."""

from __future__ import annotations

import torch
from torch import nn

from autopipe.graph.layout import Layout, layout_model, trace_modes


def layout_of(model: nn.Module, *args: torch.Tensor, **options: object) -> Layout:
    """The layout of ``model`` traced on the positional inputs ``args``."""
    return layout_model(model, trace_modes(model, args, {}, **options))
