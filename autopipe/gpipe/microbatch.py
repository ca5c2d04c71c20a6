"""Splitting a mini-batch into micro-batches along dim 0 and joining the outputs back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

import torch
from torch import Tensor

__all__: list[str] = []  # internal to the package

TensorOrTensors: TypeAlias = Tensor | tuple[Tensor, ...]


class Batch:
    """A micro-batch: a single tensor (``atomic``) or a tuple of tensors.

    Stages see exactly what the user passed: a tensor stays a tensor and a tuple stays a
    tuple, so partitions receive the same values as in the unsplit module.
    """

    __slots__ = ("atomic", "tensors")

    def __init__(self, value: TensorOrTensors) -> None:
        if isinstance(value, Tensor):
            self.atomic = True
            self.tensors: tuple[Tensor, ...] = (value,)
        else:
            self.atomic = False
            self.tensors = tuple(value)

    @property
    def value(self) -> TensorOrTensors:
        """The tensor, or the tuple of tensors."""
        return self.tensors[0] if self.atomic else self.tensors

    def replace(self, tensors: tuple[Tensor, ...]) -> Batch:
        """A batch of the same kind holding ``tensors`` instead."""
        return Batch(tensors[0] if self.atomic else tensors)

    def call(self, function: Callable[[Any], Any]) -> Batch:
        """Applies ``function`` to the value and wraps what it returns.

        Raises:
            TypeError: the function returned something other than a tensor or a tuple of
                tensors.
        """
        output = function(self.value)
        check(output, "a partition's output")
        return Batch(output)

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, index: int) -> Tensor:
        return self.tensors[index]

    def __repr__(self) -> str:
        return f"Batch[atomic={self.atomic!r}]({self.tensors!r})"


def check(value: Any, what: str = "input") -> None:
    """Checks that ``value`` is a tensor or a non-empty tuple of tensors.

    Raises:
        TypeError: it is not.
    """
    if isinstance(value, Tensor):
        return
    if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
        return
    raise TypeError(f"{what} must be a Tensor or a non-empty tuple of Tensors, got {_kind(value)}")


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(type(v).__name__ for v in value) + ")"
    return type(value).__name__


def scatter(value: TensorOrTensors, chunks: int) -> list[Batch]:
    """Splits a mini-batch into at most ``chunks`` micro-batches along dim 0.

    Sizes differ by at most one (10 samples in 4 chunks give 3, 3, 2, 2); with fewer samples
    than chunks there is one micro-batch per sample. The micro-batches are views, so no
    data is copied.

    Raises:
        TypeError: ``value`` is not a tensor or a tuple of tensors.
        ValueError: a tensor has no batch dimension, the batch is empty, or the tensors of a
            tuple disagree on the batch size.
    """
    check(value)
    tensors = (value,) if isinstance(value, Tensor) else value
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("input tensors need a batch dimension (dim 0) to split into micro-batches")
    sizes = {t.size(0) for t in tensors}
    if len(sizes) != 1:
        raise ValueError(f"input tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    (size,) = sizes
    if size == 0:
        raise ValueError("cannot split an empty batch (dim 0 has size 0) into micro-batches")
    # tensor_split balances the sizes (torch.chunk would give 3, 3, 3, 1 for 10 in 4) and
    # never yields fewer pieces than asked, so empty pieces are the only ones to drop.
    count = min(chunks, size)
    pieces = [torch.tensor_split(t, count) for t in tensors]
    if isinstance(value, Tensor):
        return [Batch(p) for p in pieces[0]]
    return [Batch(parts) for parts in zip(*pieces)]


def gather(outputs: list[Batch]) -> TensorOrTensors:
    """Concatenates micro-batch outputs along dim 0 into one mini-batch output.

    Raises:
        ValueError: outputs have no batch dimension or disagree in structure.
    """
    first = outputs[0]
    if any(b.atomic != first.atomic or len(b) != len(first) for b in outputs):
        raise ValueError("micro-batches produced outputs of different structure")
    if any(t.dim() == 0 for b in outputs for t in b):
        raise ValueError(
            "the module's output has a zero-dimensional tensor; outputs need a batch "
            "dimension (dim 0) to be concatenated"
        )
    if len(outputs) == 1:
        return first.value
    joined = tuple(_cat([b[k] for b in outputs]) for k in range(len(first)))
    return joined[0] if first.atomic else joined


def _cat(pieces: list[Tensor]) -> Tensor:
    # Under the caller's no_grad, a torch.enable_grad() region at the end of the model
    # makes outputs that require grad, as the model's own output does: keep that.
    with torch.set_grad_enabled(torch.is_grad_enabled() or any(p.requires_grad for p in pieces)):
        return torch.cat(pieces)
