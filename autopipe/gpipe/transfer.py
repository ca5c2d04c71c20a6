"""Moving micro-batches between partitions: copies on copy streams, in forward and backward.

A partition's output is copied to the next partition's device on a pair of copy streams (one
on each device) so the copy overlaps compute on both sides; the next partition's compute
stream then waits for the copy. Gradients travel back the same way in backward. Between two
CPU partitions there is nothing to copy or wait for, so no autograd node is created at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from autopipe.gpipe.microbatch import Batch
from autopipe.gpipe.stream import (
    CPU_STREAM,
    AbstractStream,
    current_stream,
    get_device,
    record_stream,
    use_stream,
    wait_stream,
)

__all__: list[str] = []  # internal to the package


@dataclass(frozen=True)
class Route:
    """The four streams a hop between two partitions uses.

    Attributes:
        prev_stream: compute stream that produced the tensors.
        prev_copy: copy stream on the producer's device.
        next_copy: copy stream on the consumer's device.
        next_stream: compute stream that consumes the tensors.
    """

    prev_stream: AbstractStream
    prev_copy: AbstractStream
    next_copy: AbstractStream
    next_stream: AbstractStream

    @property
    def trivial(self) -> bool:
        """Both ends are the CPU: the hop is the identity."""
        return self.prev_stream is CPU_STREAM and self.next_stream is CPU_STREAM

    def move(self, tensors: tuple[Tensor | None, ...], backward: bool) -> tuple[Tensor | None, ...]:
        """Copies ``tensors`` forward (producer to consumer) or backward, keeping streams safe."""
        if backward:
            src_stream, src_copy, dst_copy, dst_stream = (
                self.next_stream,
                self.next_copy,
                self.prev_copy,
                self.prev_stream,
            )
        else:
            src_stream, src_copy, dst_copy, dst_stream = (
                self.prev_stream,
                self.prev_copy,
                self.next_copy,
                self.next_stream,
            )
        device = get_device(dst_stream)
        # The copy must not start before the producer wrote the tensors. In backward the
        # autograd engine hands over gradients ready on the current stream, which may differ.
        wait_stream(src_copy, src_stream)
        if backward:
            wait_stream(src_copy, current_stream(get_device(src_stream)))
        moved: list[Tensor | None] = []
        with use_stream(src_copy), use_stream(dst_copy):
            for x in tensors:
                if x is None:
                    moved.append(None)
                    continue
                # detach() rather than returning the input: an input returned as-is from a
                # custom Function becomes a view that in-place layers may not modify.
                y = x.detach() if x.device == device else x.to(device)
                # x was allocated on the producer's stream and is read on the copy stream; y is
                # read on the consumer's stream. Without these, the caching allocator could
                # recycle their memory while those streams still use it.
                record_stream(x, src_copy)
                record_stream(y, dst_stream)
                moved.append(y)
        wait_stream(dst_stream, dst_copy)
        return tuple(moved)


class Transfer(torch.autograd.Function):
    """Moves tensors along a :class:`Route`; backward moves the gradients back."""

    @staticmethod
    def forward(ctx: Any, route: Route, *inputs: Tensor) -> tuple[Tensor, ...]:
        ctx.route = route
        # Undefined gradients (outputs nobody used) stay None instead of being filled with
        # zeros that would then be copied across devices for nothing.
        ctx.set_materialize_grads(False)
        moved = route.move(inputs, backward=False)
        for x, y in zip(inputs, moved):
            assert y is not None
            if not (x.is_floating_point() or x.is_complex()):
                ctx.mark_non_differentiable(y)
        return tuple(y for y in moved if y is not None)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        route: Route = ctx.route
        return (None, *route.move(grads, backward=True))


def transfer(batch: Batch, route: Route) -> Batch:
    """Moves ``batch`` from the producer's device and stream to the consumer's."""
    if route.trivial:
        return batch
    return batch.replace(Transfer.apply(route, *batch))
