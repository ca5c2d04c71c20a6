"""Tests for the clock-cycle schedule and the multi-worker pipeline on the CPU."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.gpipe.fill_drain import Pipeline, clock_cycles
from autopipe.gpipe.microbatch import gather, scatter
from tests.support.gpipe_support import CPU


def test_clock_cycles() -> None:
    assert list(clock_cycles(3, 2)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1)],
        [(2, 1)],
    ]
    for m, n in [(1, 1), (4, 3), (2, 5)]:
        tasks = [t for clock in clock_cycles(m, n) for t in clock]
        assert sorted(tasks) == [(i, j) for i in range(m) for j in range(n)]
        for k, clock in enumerate(clock_cycles(m, n)):
            assert all(i + j == k for i, j in clock)


class _Recorder(nn.Module):
    """Records (micro-batch marker, partition) in call order; fails when told to."""

    def __init__(self, index: int, log: list[tuple[int, int]], fail_at: set[int]) -> None:
        super().__init__()
        self.index, self.log, self.fail_at = index, log, fail_at

    def forward(self, x: Tensor) -> Tensor:
        marker = int(x[0, 0].item())
        self.log.append((marker, self.index))
        if marker in self.fail_at:
            raise RuntimeError(f"partition {self.index} failed on micro-batch {marker}")
        return x


def _stages(count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(count)]


@pytest.mark.parametrize("owners", [[0, 0, 0], [0, 1, 2], [0, 1, 0]])
@pytest.mark.parametrize("checkpoint_stop", [0, 2])
def test_matches_sequential(owners: list[int], checkpoint_stop: int) -> None:
    stages = _stages(3)
    reference = nn.Sequential(*copy.deepcopy(stages))
    pipeline = Pipeline(stages, [CPU] * 3, chunks=3, owners=owners)
    try:
        x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
        out = gather(pipeline.run(scatter(x, 3), checkpoint_stop))
        assert isinstance(out, Tensor)
        out.square().sum().backward()
        x_ref = x.detach().clone().requires_grad_()
        expected = torch.cat([reference(part) for part in x_ref.tensor_split(3)])
        expected.square().sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        assert x.grad is not None and x_ref.grad is not None
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
        for p, q in zip(nn.Sequential(*stages).parameters(), reference.parameters()):
            assert p.grad is not None and q.grad is not None
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    finally:
        pipeline.close()


def _marked(m: int) -> Tensor:
    x = torch.zeros(m, 4, dtype=torch.float64)
    x[:, 0] = torch.arange(m, dtype=torch.float64)
    return x


def test_single_worker_runs_in_clock_order() -> None:
    log: list[tuple[int, int]] = []
    pipeline = Pipeline([_Recorder(j, log, set()) for j in range(3)], [CPU] * 3, chunks=4)
    try:
        pipeline.run(scatter(_marked(4), 4), 0)
    finally:
        pipeline.close()
    assert log == [(i, j) for clock in clock_cycles(4, 3) for i, j in clock]


@pytest.mark.parametrize("owners", [[0, 0, 0], [0, 1, 2], [0, 1, 0]])
@pytest.mark.parametrize(("fail_partition", "fail_microbatch"), [(0, 0), (1, 2), (2, 3)])
def test_errors_propagate_and_pipeline_recovers(
    owners: list[int], fail_partition: int, fail_microbatch: int
) -> None:
    log: list[tuple[int, int]] = []
    fail_at: list[set[int]] = [set() for _ in range(3)]
    fail_at[fail_partition].add(fail_microbatch)
    pipeline = Pipeline(
        [_Recorder(j, log, fail_at[j]) for j in range(3)], [CPU] * 3, chunks=4, owners=owners
    )
    try:
        with pytest.raises(RuntimeError, match=f"partition {fail_partition} failed") as info:
            pipeline.run(scatter(_marked(4), 4), 0)
        assert info.traceback[-1].name == "forward"  # the raising frame is kept
        del info
        fail_at[fail_partition].clear()
        log.clear()
        outputs = pipeline.run(scatter(_marked(4), 4), 0)
        assert len(outputs) == 4 and sorted(log) == [(i, j) for i in range(4) for j in range(3)]
    finally:
        pipeline.close()


class _BackwardLog(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, log: list[tuple[int, int]], index: int) -> Tensor:
        ctx.log, ctx.entry = log, (int(x[0, 0].item()), index)
        return x * 1

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        ctx.log.append(ctx.entry)
        return grad, None, None


class _LogStage(nn.Module):
    def __init__(self, index: int, log: list[tuple[int, int]]) -> None:
        super().__init__()
        self.index, self.log = index, log

    def forward(self, x: Tensor) -> Tensor:
        return _BackwardLog.apply(x, self.log, self.index)


@pytest.mark.parametrize("owners", [[0, 0, 0], [0, 1, 2]])
@pytest.mark.parametrize("checkpoint_stop", [0, 4])
def test_backward_runs_micro_batches_in_reverse(owners: list[int], checkpoint_stop: int) -> None:
    log: list[tuple[int, int]] = []
    stages = [_LogStage(j, log) for j in range(3)]
    pipeline = Pipeline(stages, [CPU] * 3, chunks=4, owners=owners)
    try:
        x = _marked(4).requires_grad_()
        out = gather(pipeline.run(scatter(x, 4), checkpoint_stop))
        assert isinstance(out, Tensor)
        out.sum().backward()
    finally:
        pipeline.close()
    for j in (1, 2):
        assert [i for i, stage in log if stage == j] == [3, 2, 1, 0]


def test_concurrent_callers() -> None:
    stages = _stages(2)
    reference = nn.Sequential(*copy.deepcopy(stages))
    pipeline = Pipeline(stages, [CPU] * 2, chunks=2, owners=[0, 1])
    results: dict[int, bool] = {}

    def call(seed: int) -> None:
        x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        for _ in range(20):
            with torch.no_grad():
                out = gather(pipeline.run(scatter(x, 2), 0))
                results[seed] = torch.allclose(out, reference(x))  # type: ignore[arg-type]

    callers = [threading.Thread(target=call, args=(s,)) for s in range(3)]
    try:
        for t in callers:
            t.start()
        for t in callers:
            t.join(timeout=60)
        assert results == {0: True, 1: True, 2: True}
    finally:
        pipeline.close()
