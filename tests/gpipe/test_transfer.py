"""Tests for stream helpers and cross-partition transfers (CPU no-ops; CUDA when present)."""

from __future__ import annotations

import torch

from autopipe.gpipe.microbatch import Batch
from autopipe.gpipe.stream import (
    CPU_STREAM,
    current_stream,
    default_stream,
    get_device,
    is_cuda,
    new_stream,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)
from autopipe.gpipe.transfer import Route, Transfer, transfer
from tests.support.gpipe_support import CPU, needs_cuda


def test_cpu_streams_are_no_ops() -> None:
    for make in (new_stream, current_stream, default_stream):
        assert make(CPU) is CPU_STREAM
    assert not is_cuda(CPU_STREAM) and get_device(CPU_STREAM) == CPU
    with use_stream(CPU_STREAM), use_device(CPU):
        wait_stream(CPU_STREAM, CPU_STREAM)
        record_stream(torch.zeros(1), CPU_STREAM)


def test_cpu_route_is_trivial() -> None:
    route = Route(CPU_STREAM, CPU_STREAM, CPU_STREAM, CPU_STREAM)
    batch = Batch(torch.zeros(2))
    assert route.trivial and transfer(batch, route) is batch


def test_transfer_function_on_cpu() -> None:
    # The autograd function itself works on CPU streams: values pass, gradients come back.
    route = Route(CPU_STREAM, CPU_STREAM, CPU_STREAM, CPU_STREAM)
    x = torch.randn(3, requires_grad=True)
    ids = torch.arange(3)
    y, moved_ids = Transfer.apply(route, x * 2, ids)
    assert torch.equal(y, x * 2) and torch.equal(moved_ids, ids)
    assert y.requires_grad and not moved_ids.requires_grad
    y.relu_().sum().backward()  # in-place on the output is allowed
    assert x.grad is not None


@needs_cuda
def test_transfer_between_streams_on_cuda() -> None:
    device = torch.device("cuda", 0)
    streams = [new_stream(device) for _ in range(4)]
    assert all(is_cuda(s) and get_device(s) == device for s in streams)
    route = Route(*streams)
    x = torch.randn(1000, device=device, requires_grad=True)
    with use_stream(streams[0]):
        produced = x * 2
    out = transfer(Batch(produced), route)
    with use_stream(streams[3]):
        result = out[0] * 3
        result.sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(result, x.detach() * 6)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, 6.0))


@needs_cuda
def test_transfer_cpu_to_cuda_and_back() -> None:
    device = torch.device("cuda", 0)
    to_gpu = Route(CPU_STREAM, CPU_STREAM, new_stream(device), new_stream(device))
    x = torch.randn(5, requires_grad=True)
    on_gpu = transfer(Batch(x * 1), to_gpu)[0]
    assert on_gpu.device == device
    back = Route(to_gpu.next_stream, new_stream(device), CPU_STREAM, CPU_STREAM)
    on_cpu = transfer(Batch(on_gpu * 2), back)[0]
    assert on_cpu.device == CPU
    on_cpu.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
