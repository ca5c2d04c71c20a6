"""Re-materialization: run a partition without keeping activations, recompute them in backward.

A checkpointed micro-batch keeps only its partition input. In backward the partition runs
again with the random number generator states of the first run, so dropout draws the same
mask, and batch-norm running statistics are put back afterwards so they are updated once per
forward, as without checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from autopipe.gpipe.autocast_state import AutocastState
from autopipe.gpipe.microbatch import Batch, TensorOrTensors
from autopipe.microbatching import BufferSnapshot, checkpointing, recomputing

__all__: list[str] = []  # internal to the package


class RNGState:
    """The CPU generator state and, for a CUDA device, that device's generator state."""

    __slots__ = ("cpu", "cuda", "device")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Runs the block with the saved states, then puts the current states back.

        Putting them back matters: recomputation must not change the random numbers the rest
        of the program draws.
        """
        cuda_devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=cuda_devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


@contextlib.contextmanager
def _frozen_running_stats(function: Callable[..., Any]) -> Iterator[None]:
    """Restores batch-norm running statistics changed inside the block."""
    saved: list[tuple[Tensor, Tensor]] = []
    if isinstance(function, nn.Module):
        for module in function.modules():
            if isinstance(module, _BatchNorm) and module.training:
                for buffer in (module.running_mean, module.running_var, module.num_batches_tracked):
                    if buffer is not None:
                        saved.append((buffer, buffer.clone()))
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


class _OutputKind:
    """Filled in by :meth:`Checkpoint.forward`: whether the function returned one tensor."""

    __slots__ = ("atomic",)

    def __init__(self) -> None:
        self.atomic = True


def _copies(tensors: tuple[Tensor, ...], atomic: bool) -> Batch:
    copies = tuple(t.clone() for t in tensors)
    return Batch(copies[0] if atomic else copies)


class Checkpoint(torch.autograd.Function):
    """Runs ``function`` without recording a graph; backward recomputes it with one."""

    @staticmethod
    def forward(
        ctx: Any,
        phony: Tensor,
        function: Callable[[TensorOrTensors], TensorOrTensors],
        device: torch.device,
        atomic: bool,
        kind: _OutputKind,
        *inputs: Tensor,
    ) -> tuple[Tensor, ...]:
        ctx.function = function
        ctx.atomic = atomic
        # The buffers it may write, as this run finds them: the re-computation's inputs.
        ctx.buffers = BufferSnapshot(function) if isinstance(function, nn.Module) else None
        ctx.rng = RNGState(device)
        ctx.autocast = AutocastState()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        # The partition gets copies: a first layer working in place (ReLU(inplace=True))
        # would otherwise change the input kept for recomputation, silently.
        with checkpointing():
            batch = _copies(inputs, atomic).call(function)
        # Detached references: an output returned as-is from a custom Function becomes a view
        # that later in-place layers may not modify.
        outputs = tuple(t.detach() for t in batch)
        kind.atomic = batch.atomic
        for t in outputs:
            if not (t.is_floating_point() or t.is_complex()):
                ctx.mark_non_differentiable(t)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        inputs = ctx.saved_tensors
        leaves = tuple(x.detach().requires_grad_(x.requires_grad) for x in inputs)
        function = ctx.function
        # The statistics are put back only after backward: the recomputed batch-norm nodes
        # saved the running buffers and check that they did not change.
        with _frozen_running_stats(function):
            # Recomputed as first computed: same random numbers, same autocast dtypes.
            buffers = ctx.buffers.restored() if ctx.buffers else contextlib.nullcontext()
            with (
                ctx.rng.restored(),
                ctx.autocast.applied(),
                recomputing(),
                torch.enable_grad(),
                buffers,
            ):
                # Copies again: in-place layers may not modify a leaf that requires grad.
                output = function(_copies(leaves, ctx.atomic).value)
            outputs = (output,) if isinstance(output, Tensor) else tuple(output)
            pairs = [(y, g) for y, g in zip(outputs, grads) if g is not None and y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        grads_in = tuple(leaf.grad if leaf.requires_grad else None for leaf in leaves)
        return (None, None, None, None, None, *grads_in)


def checkpoint(
    function: Callable[[TensorOrTensors], TensorOrTensors], batch: Batch, device: torch.device
) -> Batch:
    """Runs ``function`` on ``batch`` keeping only the input for backward.

    Args:
        function: the partition to run.
        batch: its input micro-batch.
        device: the device it runs on, whose generator state is saved for recomputation.

    Returns:
        The output micro-batch, with a tuple or a tensor as ``function`` returned.
    """
    kind = _OutputKind()
    # The parameters are not inputs of the autograd function, so when the input needs no
    # gradient (the first partition) this phony is what makes the output require one.
    phony = torch.empty(0, device=device, requires_grad=True)
    outputs = Checkpoint.apply(phony, function, device, batch.atomic, kind, *batch)
    return Batch(outputs[0] if kind.atomic else outputs)
