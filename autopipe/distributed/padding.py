"""Uneven micro-batches on torch pipelining: each padded to the largest, cut before the loss.

torch's pipeline stages allocate their receive buffers for one micro-batch shape. A
mini-batch of N rows in M micro-batches (N not a multiple of M) is split as everywhere else
in autopipe, ``tensor_split``: sizes ⌈N/M⌉ and ⌊N/M⌋. Each smaller micro-batch is padded to
⌈N/M⌉ rows by repeating its last row (real data, so the padding computes finite values),
and the loss sees only the real rows. The padding rows then get zero gradient, and the
parameters' gradients are exactly those of the unpadded micro-batches, provided no layer
mixes rows of a batch: BatchNorm in training does (the padding would enter its batch
statistics), so such models need a batch that is a multiple of M.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__: list[str] = []  # internal to the distributed runner


def rows_mixing_layer(modules: Iterable[tuple[str, nn.Module]]) -> str | None:
    """The name of the first layer whose output depends on other rows of the batch."""
    for name, module in modules:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
            return name
    return None


def per_batch_problem(outputs: Sequence[str], batch: int, chunks: int) -> str | None:
    """Why outputs computed once per micro-batch need a batch that is a multiple of chunks,
    or ``None`` when it is one or there are none."""
    if not outputs or batch % chunks == 0:
        return None
    # The model computes them from all rows of a micro-batch, padding rows included.
    return (
        f"the batch size {batch} is not a multiple of chunks={chunks} and the model's "
        f"outputs {', '.join(outputs)} are computed from whole micro-batches, which would "
        "include padding rows; use a batch size that is a multiple of chunks"
    )


class MicroBatchPadding:
    """How a mini-batch of ``batch`` rows in ``chunks`` micro-batches is padded.

    Attributes:
        sizes: the real rows of each micro-batch, in order.
        rows: the rows of every padded micro-batch (the largest size).
        even: whether nothing needs padding.
    """

    def __init__(self, batch: int, chunks: int) -> None:
        if not 0 < chunks <= batch:
            raise ValueError(f"cannot split {batch} rows into {chunks} micro-batches")
        self.sizes = [len(part) for part in torch.arange(batch).tensor_split(chunks)]
        self.rows = max(self.sizes)
        self.even = min(self.sizes) == self.rows
        index, start = [], 0
        for size in self.sizes:
            index += list(range(start, start + size)) + [start + size - 1] * (self.rows - size)
            start += size
        self._index = torch.tensor(index)
        self._target: Tensor | None = None
        self._calls = 0

    def pad(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """The mini-batch's tensors with every micro-batch padded to :attr:`rows` rows."""
        if self.even:
            return tensors
        return tuple(t.index_select(0, self._index.to(t.device)) for t in tensors)

    def pad_target(self, target: Tensor) -> Tensor:
        """The padded target; the micro-batches the schedule cuts from it are recognised."""
        self._target = padded = self.pad((target,))[0]
        self._calls = 0
        return padded

    def micro_batch(self, target: Tensor) -> int:
        """Which micro-batch ``target`` (a slice of the padded target) is.

        Its offset into the padded target tells; a copy of the slice is counted in call
        order instead, as the schedules compute the losses of a stage in micro-batch order.
        """
        whole = self._target
        self._calls += 1
        if whole is not None and whole.dim() and target.dim() and whole.stride(0):
            same = target.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            if same:
                offset = target.storage_offset() - whole.storage_offset()
                return offset // (self.rows * whole.stride(0))
        return (self._calls - 1) % len(self.sizes)

    def loss(self, loss_fn: Callable[[Any, Any], Tensor]) -> Callable[[Any, Any], Tensor]:
        """``loss_fn`` on the real rows of a padded micro-batch's output and target."""
        if self.even:
            return loss_fn

        def real_rows(output: Any, target: Tensor) -> Tensor:
            size = self.sizes[self.micro_batch(target)]
            return loss_fn(self._cut(output, size), target[:size])

        return real_rows

    def _cut(self, output: Any, size: int) -> Any:
        if isinstance(output, Tensor):
            return output[:size] if output.dim() and output.shape[0] == self.rows else output
        if isinstance(output, (tuple, list)):
            return type(output)(self._cut(value, size) for value in output)
        return output
