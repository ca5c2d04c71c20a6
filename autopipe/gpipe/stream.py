"""Stream helpers that use CUDA streams on GPUs and cost next to nothing on the CPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__: list[str] = []  # internal to the package


class CPUStream:
    """The stream of the CPU: work on it runs in program order, so every operation is a no-op."""

    device = torch.device("cpu")

    def __repr__(self) -> str:
        return "CPUStream()"


# One shared instance: identity checks (``stream is CPU_STREAM``) are the cheapest test on the
# hot path of every micro-batch.
CPU_STREAM = CPUStream()

AbstractStream = torch.cuda.Stream | CPUStream


def new_stream(device: torch.device) -> AbstractStream:
    """Returns a new stream on ``device`` (the CPU stream for CPU devices)."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    """Returns the stream that work on ``device`` is currently issued to."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    """Returns the default stream of ``device``."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.default_stream(device)


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is a CUDA stream."""
    return stream is not CPU_STREAM


def get_device(stream: AbstractStream) -> torch.device:
    """The device ``stream`` belongs to."""
    return stream.device


@contextlib.contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Makes ``device`` the current CUDA device for the block; a no-op for the CPU."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def use_stream(stream: AbstractStream) -> contextlib.AbstractContextManager[object]:
    """Makes ``stream`` the current stream of its device for a ``with`` block."""
    if stream is CPU_STREAM:
        return contextlib.nullcontext()
    assert isinstance(stream, torch.cuda.Stream)
    return torch.cuda.stream(stream)


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Makes ``source`` wait until the work issued so far to ``target`` is done."""
    if isinstance(source, torch.cuda.Stream) and isinstance(target, torch.cuda.Stream):
        source.wait_stream(target)
    # A CUDA stream never needs to wait for the CPU (CPU work is already done when the call
    # returns) and the CPU never waits for a CUDA stream here: tensors handed to the CPU were
    # produced by a synchronous copy.


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tells the caching allocator that ``tensor`` is used on ``stream``.

    Without this the memory of a tensor allocated on one stream could be handed out again
    while a kernel on another stream still reads it.
    """
    if not isinstance(stream, torch.cuda.Stream) or tensor.device.type != "cuda":
        return
    # record_stream needs a tensor that owns or views a CUDA allocation; a zero-size tensor may
    # own none.
    if tensor.numel() == 0:
        return
    tensor.record_stream(stream)
