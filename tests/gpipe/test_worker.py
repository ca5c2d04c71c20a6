"""Tests for the persistent worker threads."""

from __future__ import annotations

import gc
import queue
import threading
from collections.abc import Callable

import pytest
import torch

from autopipe.gpipe.worker import ThreadContext, WorkerPool
from tests.support.gpipe_support import CPU, worker_threads


def _run(pool: WorkerPool, worker: int, fn: Callable[[], object]) -> object:
    out: queue.SimpleQueue[object] = queue.SimpleQueue()
    pool.submit(worker, lambda: out.put(fn()))
    return out.get(timeout=30)


def test_one_worker_per_device_and_reuse() -> None:
    baseline = worker_threads()
    pool = WorkerPool([CPU, CPU, CPU])
    assert len(pool) == 1 and pool.owners == [0, 0, 0]
    first = _run(pool, 0, threading.get_ident)
    assert first == _run(pool, 0, threading.get_ident) != threading.get_ident()
    assert worker_threads() == baseline + 1
    pool.close()
    assert pool.closed and worker_threads() == baseline
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(0, lambda: None)


def test_explicit_owners() -> None:
    pool = WorkerPool([CPU, CPU, CPU], owners=[0, 1, 1])
    try:
        assert len(pool) == 2 and pool.owners == [0, 1, 1]
        assert _run(pool, 0, threading.get_ident) != _run(pool, 1, threading.get_ident)
    finally:
        pool.close()
    with pytest.raises(ValueError, match="owners"):
        WorkerPool([CPU, CPU], owners=[0, 2])


def test_garbage_collection_stops_threads() -> None:
    baseline = worker_threads()
    pool = WorkerPool([CPU], owners=[0])
    threads = pool.threads()
    del pool
    gc.collect()
    assert not any(t.is_alive() for t in threads)
    assert worker_threads() == baseline


def test_failing_job_keeps_worker_alive() -> None:
    pool = WorkerPool([CPU])
    try:

        def fail() -> None:
            raise ZeroDivisionError("job failed")

        pool.submit(0, fail)
        assert _run(pool, 0, lambda: 42) == 42
    finally:
        pool.close()


def test_thread_context_carries_grad_mode_and_threads() -> None:
    with torch.no_grad():
        context = ThreadContext()
    pool = WorkerPool([CPU])

    def probe() -> tuple[bool, int]:
        with context.applied():
            return torch.is_grad_enabled(), torch.get_num_threads()

    try:
        assert _run(pool, 0, probe) == (False, torch.get_num_threads())
        assert _run(pool, 0, torch.is_grad_enabled) is True  # only inside the block
    finally:
        pool.close()


def test_thread_context_carries_saved_tensor_hooks_and_autocast() -> None:
    packed: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t)
        return t

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16),
    ):
        context = ThreadContext()
    x = torch.randn(2, 2, requires_grad=True)

    def work() -> torch.dtype:
        with context.applied():
            return (x @ x).dtype

    pool = WorkerPool([CPU])
    try:
        assert _run(pool, 0, work) == torch.bfloat16
    finally:
        pool.close()
    assert packed
