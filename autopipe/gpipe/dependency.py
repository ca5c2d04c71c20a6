"""Zero-size autograd edges ("phonies") that order backward passes of different micro-batches.

``fork`` on a tensor returns the tensor and a phony; ``join`` ties a phony into another
tensor. In backward the forked tensor's gradient cannot flow on until the joined tensor's
gradient has been computed, so the pipeline can make micro-batch ``i`` finish backward on a
partition before micro-batch ``i - 1`` starts there, without copying any data.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from autopipe.gpipe.microbatch import Batch

__all__: list[str] = []  # internal to the package


class Fork(torch.autograd.Function):
    """``x -> (x, phony)``; backward waits for the gradients of both outputs."""

    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        # A fresh zero-size tensor per call: it allocates no device memory, and a shared one
        # would have its grad_fn overwritten by every call.
        return input.detach(), torch.empty(0, device=input.device)

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_phony: Tensor | None) -> Tensor:
        return grad_input


class Join(torch.autograd.Function):
    """``(x, phony) -> x``; backward sends an empty gradient to the phony."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, phony: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> tuple[Tensor, None]:
        return grad_input, None


def anchor(batch: Batch) -> int | None:
    """Index of the tensor in ``batch`` that carries dependencies: the first floating one.

    Integer tensors cannot take part in autograd, so a batch made of them only has no anchor.
    """
    for index, tensor in enumerate(batch):
        if tensor.is_floating_point() or tensor.is_complex():
            return index
    return None


def fork(batch: Batch) -> tuple[Batch, Tensor | None]:
    """Forks the anchor tensor of ``batch``: returns the new batch and the phony.

    The phony is ``None`` when there is nothing to order (no anchor, or no gradient).
    """
    index = anchor(batch)
    if index is None or not batch[index].requires_grad:
        return batch, None
    tensors = list(batch)
    tensors[index], phony = Fork.apply(tensors[index])
    return batch.replace(tuple(tensors)), phony


def join(batch: Batch, phony: Tensor | None) -> Batch:
    """Joins ``phony`` into the anchor tensor of ``batch`` (a no-op for ``None``)."""
    if phony is None:
        return batch
    index = anchor(batch)
    if index is None:
        return batch
    tensors = list(batch)
    tensors[index] = Join.apply(tensors[index], phony)
    return batch.replace(tuple(tensors))
