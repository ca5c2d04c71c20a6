"""The sample a model is profiled on: its tensors, the first layer's call, other batch sizes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__: list[str] = []

Inputs = tuple[Tensor, ...]


def sample_arguments(sample: Any) -> tuple[Inputs, bool]:
    """The sample's tensors, and whether the first layer takes them as one tuple.

    The sample is the model's positional inputs, ``model(*sample)``; a tensor is one
    input. A single input that is itself a tuple of tensors (``((a, b),)``) reaches the
    first layer as one value, as ``nn.Sequential`` passes its input on.

    Raises:
        ValueError: not tensors sharing a non-zero batch dimension.
    """
    packed = isinstance(sample, (tuple, list)) and len(sample) == 1 and isinstance(sample[0], tuple)
    return _sample_tensors(sample[0] if packed else sample), packed


def _sample_tensors(sample: Any) -> Inputs:
    """The sample as a tuple of tensors sharing a non-zero batch dimension."""
    if isinstance(sample, Tensor):
        tensors: Inputs = (sample,)
    elif isinstance(sample, (tuple, list)) and sample:
        if not all(isinstance(t, Tensor) for t in sample):
            kinds = ", ".join(type(t).__name__ for t in sample)
            raise ValueError(
                f"sample must be a tensor or a tuple of tensors, got a tuple of {kinds}"
            )
        tensors = tuple(sample)
    else:
        raise ValueError(
            f"sample must be a tensor or a non-empty tuple of tensors, got {type(sample).__name__}"
        )
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("sample tensors need a batch dimension (dim 0); got a 0-d tensor")
    sizes = [t.shape[0] for t in tensors]
    if len(set(sizes)) > 1:
        raise ValueError(f"sample tensors disagree on the batch size (dim 0): {sizes}")
    if sizes[0] == 0:
        raise ValueError("sample has an empty batch (dim 0 is 0); it needs at least one sample")
    return tensors


def sequential_inputs_problem(model: nn.Module, sample: Any) -> str | None:
    """Why ``model(*sample)`` cannot run for an ``nn.Sequential``, or ``None``.

    ``nn.Sequential`` takes one input (a subclass may define a ``forward`` of its own), so
    a sample of several tensors has no plain call; a tuple for the first layer is the
    sample's one input: ``((a, b),)``.
    """
    if not isinstance(model, nn.Sequential) or type(model).forward is not nn.Sequential.forward:
        return None
    if not isinstance(sample, (tuple, list)) or len(sample) < 2:
        return None
    return (
        f"an nn.Sequential takes one input, not {len(sample)} (the sample is the model's "
        "positional inputs, model(*sample)): pass ((a, b),) to give its first layer the "
        "tuple as one value, or a model whose forward takes the inputs"
    )


def resize_sample(tensors: Inputs, size: int, device: torch.device) -> Inputs:
    """The sample at another batch size, repeating it when ``size`` exceeds it.

    Every result owns a fresh storage, so saved-tensor bytes count only ``size`` rows.
    """
    out = []
    with torch.no_grad():
        for t in tensors:
            rows = torch.arange(size, device=t.device) % t.shape[0]
            out.append(t.detach().index_select(0, rows).to(device))
    return tuple(out)
