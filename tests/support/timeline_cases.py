"""Plans of known layer times, and the ordering constraints every simulated step obeys."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate
from autopipe.planning.schedules.simulation import Event, checkpointed
from tests.support.planning_cases import linear_profile

CHECKPOINTS = ("always", "except_last", "never")
SCHEDULES = ("gpipe", "1f1b")
# Integer-valued layer times keep the simulated sums exact enough for tight comparisons.
FORWARD = [1.0, 2.0, 3.0, 1.0, 1.0, 4.0]


def make_plan(
    balance: list[int],
    forward: list[float] | None = None,
    *,
    chunks: int = 4,
    checkpoint: str = "never",
    schedule: str = "gpipe",
    bandwidth: float | None = None,
    output: list[int] | None = None,
    virtual_stages: int = 1,
) -> Plan:
    forward = FORWARD if forward is None else forward
    profile = linear_profile(forward, output=output, batch=8 * chunks, chunks=chunks)
    return evaluate(
        profile,
        balance,
        chunks=chunks,
        checkpoint=checkpoint,
        schedule=schedule,
        bandwidth=bandwidth,
        virtual_stages=virtual_stages,
    )


def by_key(events: list[Event]) -> dict[tuple[str, int, int], Event]:
    """Events by (kind, stage, micro-batch), checking that each occurs once."""
    table: dict[tuple[str, int, int], Event] = {}
    for e in events:
        key = (e.kind, e.stage, e.micro_batch)
        assert key not in table, f"duplicate event {key}"
        table[key] = e
    return table


def check_schedule(plan: Plan, events: list[Event]) -> None:
    """Every ordering constraint of a pipeline step holds."""
    k_count, m = plan.num_stages, plan.chunks
    table = by_key(events)
    eps = 1e-9 * max(plan.step_time, 1.0)
    # One forward and one backward per (stage, micro-batch); nothing else but recomputes
    # of checkpointed micro-batches and sends of non-last stages.
    for k in range(k_count):
        for i in range(m):
            assert ("forward", k, i) in table and ("backward", k, i) in table
            assert (("recompute", k, i) in table) == checkpointed(plan, i)
            sends = plan.stages[k].transfer > 0 and k < k_count - 1
            assert (("transfer", k, i) in table) == sends
    assert len(table) == len(events)
    # A device runs one thing at a time (stage s on device s mod K with virtual stages).
    devices = k_count // plan.virtual_stages
    per_device: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        assert e.end >= e.start >= 0
        per_device[e.stage % devices].append(e)
    for row in per_device.values():
        row.sort(key=lambda e: (e.start, e.end))
        for a, b in itertools.pairwise(row):
            assert b.start >= a.end - eps, (a, b)
    for k in range(k_count):
        for i in range(m):
            fwd, bwd = table[("forward", k, i)], table[("backward", k, i)]
            # The forward needs the previous stage's output, sent.
            if k > 0:
                prev = table.get(("transfer", k - 1, i), table[("forward", k - 1, i)])
                assert fwd.start >= prev.end - eps
            send = table.get(("transfer", k, i))
            if send is not None:
                assert send.start == pytest.approx(fwd.end)
            # The backward needs this stage's forward and the next stage's backward.
            assert bwd.start >= fwd.end - eps
            if k < k_count - 1:
                assert bwd.start >= table[("backward", k + 1, i)].end - eps
            # A recompute runs right before its backward.
            again = table.get(("recompute", k, i))
            if again is not None:
                assert again.end == pytest.approx(bwd.start)
                assert again.start >= fwd.end - eps
                if k < k_count - 1:
                    assert again.start >= table[("backward", k + 1, i)].end - eps


# Virtual stages: (K, v, M) with M a multiple of interleaved 1F1B's rounds.
VIRTUAL = [(2, 2, 4), (2, 3, 2), (3, 2, 3), (3, 2, 6), (2, 2, 1), (2, 4, 8)]


def virtual_plan(
    k: int, v: int, m: int, schedule: str, checkpoint: str = "never", **options: object
) -> Plan:
    forward = [float(1 + (3 * i) % 5) for i in range(2 * k * v)]  # uneven stages
    return make_plan(
        [2] * (k * v),
        forward,
        chunks=m,
        schedule=schedule,
        checkpoint=checkpoint,
        virtual_stages=v,
        **options,  # type: ignore[arg-type]
    )
