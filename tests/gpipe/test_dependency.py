"""Tests for the fork/join dependencies that order backward passes."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

from autopipe.gpipe.dependency import anchor, fork, join
from autopipe.gpipe.microbatch import Batch


class _Log(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, name: str, log: list[str]) -> Tensor:
        ctx.name, ctx.log = name, log
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append(ctx.name)
        return grad, None, None


def _order(with_dependency: bool) -> list[str]:
    """Backward order of a node before a fork and a node after the matching join.

    The forked branch is recorded on another thread, as pipeline workers do. Autograd
    sequence numbers are per thread, so the engine's own order between the branches says
    nothing about which was recorded first; here the other thread's numbers are larger.
    """
    log: list[str] = []
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(2, requires_grad=True)
    box: dict[str, Any] = {}

    def record_forked() -> None:
        for _ in range(100):  # advance this thread's sequence numbers
            a * 1
        forked = Batch(_Log.apply(a, "forked", log))
        box["forked"], box["phony"] = fork(forked) if with_dependency else (forked, None)

    thread = threading.Thread(target=record_forked)
    thread.start()
    thread.join()
    joined = join(Batch(_Log.apply(b, "joined-input", log)), box["phony"])
    after_join = _Log.apply(joined[0], "after-join", log)
    (after_join.sum() + box["forked"][0].sum()).backward()
    assert a.grad is not None and b.grad is not None
    assert torch.equal(a.grad, torch.ones(2)) and torch.equal(b.grad, torch.ones(2))
    return log


def _in_fresh_thread(with_dependency: bool) -> list[str]:
    # A new thread's sequence numbers start low, whatever this thread recorded before.
    result: list[list[str]] = []
    thread = threading.Thread(target=lambda: result.append(_order(with_dependency)))
    thread.start()
    thread.join()
    return result[0]


def test_join_runs_backward_before_fork() -> None:
    free = _in_fresh_thread(with_dependency=False)
    assert free.index("forked") < free.index("after-join")
    ordered = _in_fresh_thread(with_dependency=True)
    assert ordered.index("after-join") < ordered.index("forked")


def test_fork_join_values_unchanged() -> None:
    x = torch.randn(3, requires_grad=True)
    forked, phony = fork(Batch(x * 2))
    assert phony is not None and phony.numel() == 0 and phony.requires_grad
    assert torch.equal(forked[0], x * 2)
    joined = join(Batch(torch.zeros(3)), phony)
    assert joined[0].requires_grad and torch.equal(joined[0], torch.zeros(3))


def test_nothing_to_order_without_grad() -> None:
    batch = Batch(torch.zeros(2))
    same, phony = fork(batch)
    assert same is batch and phony is None
    assert join(batch, None) is batch


def test_anchor_skips_integer_tensors() -> None:
    assert anchor(Batch((torch.arange(2), torch.zeros(2)))) == 1
    assert anchor(Batch(torch.arange(2))) is None
    ids = Batch((torch.arange(2),))
    assert join(ids, torch.empty(0, requires_grad=True)) is ids
