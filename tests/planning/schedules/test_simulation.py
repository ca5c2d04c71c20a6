"""The simulated step: every schedule's order, its constraints and its makespan."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate
from autopipe.planning.schedules.interleaving import rank_order
from autopipe.planning.schedules.simulation import makespan, simulate, stage_times
from tests.support.planning_cases import linear_profile, splits, uneven_profile
from tests.support.timeline_cases import (
    CHECKPOINTS,
    SCHEDULES,
    VIRTUAL,
    check_schedule,
    make_plan,
    virtual_plan,
)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("balance", [[6], [2, 2, 2], [1, 2, 3], [3, 2, 1], [2, 4], [1] * 6])
def test_constraints_hold(balance: list[int], checkpoint: str, schedule: str) -> None:
    plan = make_plan(balance, checkpoint=checkpoint, schedule=schedule)
    events = simulate(plan)
    check_schedule(plan, events)
    assert events == sorted(events, key=lambda e: (e.start, e.stage))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_constraints_hold_with_transfers(schedule: str) -> None:
    plan = make_plan(
        [1, 2, 3],
        checkpoint="except_last",
        schedule=schedule,
        bandwidth=100.0,
        output=[100, 300, 200, 50, 400, 10],
    )
    assert [s.transfer > 0 for s in plan.stages] == [True, True, False]
    events = simulate(plan)
    check_schedule(plan, events)
    sends = [e for e in events if e.kind == "transfer"]
    assert len(sends) == 2 * plan.chunks
    # Stage 0 sends layer 0's output, stage 1 layer 2's, at 100 B/s.
    assert [e.duration for e in sends if e.stage == 0] == pytest.approx([1.0] * plan.chunks)
    assert [e.duration for e in sends if e.stage == 1] == pytest.approx([2.0] * plan.chunks)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("balance", [[2, 2, 2], [1, 2, 3], [3, 2, 1], [1, 5], [6], [1] * 6])
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_gpipe_makespan_is_the_formula(balance: list[int], checkpoint: str, chunks: int) -> None:
    # Backward is twice the forward in every layer: forward and backward are proportional.
    plan = make_plan(balance, chunks=chunks, checkpoint=checkpoint)
    times = [s.time for s in plan.stages]
    formula = sum(times) + (chunks - 1) * max(times)
    assert plan.step_time == pytest.approx(formula)
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time, rel=1e-12)


def test_gpipe_except_last_balanced_excess() -> None:
    # The one micro-batch that skips its recompute goes backward first, so the balanced
    # pipeline is longer than the averaged formula by exactly (K−1)·f/M.
    plan = make_plan([2, 2, 2], [1.0] * 6, chunks=4, checkpoint="except_last")
    f = stage_times(plan)[0].forward
    assert f == pytest.approx(2.0)
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time + 2 * f / 4)


@pytest.mark.parametrize("balance", list(splits(6, 3)))
@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_gpipe_except_last_is_close(balance: list[int], chunks: int) -> None:
    plan = make_plan(balance, chunks=chunks, checkpoint="except_last")
    k = plan.num_stages
    f_max = max(t.forward for t in stage_times(plan))
    gap = makespan(simulate(plan)) - plan.step_time
    assert abs(gap) <= (chunks + k - 1) / chunks * f_max * (1 + 1e-12)


def test_gpipe_transfers_only_lengthen() -> None:
    # A send lengthens only the forward phase, so forward and backward are no longer
    # proportional: the two-phase schedule is at least the formula.
    # Stage 1 sends for 8 s: the forward phase's bottleneck is stage 1 (5 + 8 s), the
    # backward phase's stage 2 (12 s), while the formula's is stage 1 (5 + 8 + 10 s).
    plan = make_plan([1, 2, 3], bandwidth=10.0, output=[10, 5, 80, 5, 5, 5])
    assert [s.time for s in plan.stages] == pytest.approx([4.0, 23.0, 18.0])
    gap = (plan.chunks - 1) * ((13.0 + 12.0) - 23.0)
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time + gap)

    # When the same stage is the bottleneck in both phases, sends change nothing.
    plan = make_plan([1, 2, 3], bandwidth=10.0, output=[10, 40, 5, 5, 5, 5])
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 4, 9])
@pytest.mark.parametrize("balance", [[3, 3], [2, 2, 2], [1] * 6])
def test_1f1b_equals_gpipe_for_equal_stages(
    balance: list[int], chunks: int, checkpoint: str
) -> None:
    forward = [1.0] * 6
    gpipe = make_plan(balance, forward, chunks=chunks, checkpoint=checkpoint)
    one = make_plan(balance, forward, chunks=chunks, checkpoint=checkpoint, schedule="1f1b")
    assert makespan(simulate(one)) == pytest.approx(makespan(simulate(gpipe)), rel=1e-12)
    assert makespan(simulate(one)) == pytest.approx(one.step_time, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    forward=st.lists(st.integers(1, 9).map(float), min_size=2, max_size=7),
    data=st.data(),
    chunks=st.sampled_from([1, 2, 3, 5, 8]),
    checkpoint=st.sampled_from(["always", "never"]),
)
def test_1f1b_never_exceeds_the_formula(
    forward: list[float], data: st.DataObject, chunks: int, checkpoint: str
) -> None:
    k = data.draw(st.integers(1, len(forward)))
    balance = data.draw(st.sampled_from(list(splits(len(forward), k))))
    plan = make_plan(balance, forward, chunks=chunks, checkpoint=checkpoint, schedule="1f1b")
    events = simulate(plan)
    check_schedule(plan, events)
    assert makespan(events) <= plan.step_time * (1 + 1e-12)


def test_1f1b_order() -> None:
    # Stage k runs K−k−1 warm-up forwards, then alternates forward and backward.
    plan = make_plan([2, 2, 2], [1.0] * 6, chunks=5, schedule="1f1b")
    events = simulate(plan)
    for k in range(3):
        ops = [(e.kind[0], e.micro_batch) for e in events if e.stage == k]
        warmup = 3 - k - 1
        assert ops[:warmup] == [("f", i) for i in range(warmup)]
        steady = ops[warmup : warmup + 2 * (5 - warmup)]
        assert steady[0::2] == [("f", i) for i in range(warmup, 5)]
        assert steady[1::2] == [("b", i) for i in range(5 - warmup)]
        assert ops[len(steady) + warmup :] == [("b", i) for i in range(5 - warmup, 5)]


def test_gpipe_order() -> None:
    plan = make_plan([3, 3], chunks=3)
    for k in range(2):
        ops = [(e.kind, e.micro_batch) for e in simulate(plan) if e.stage == k]
        forwards = [("forward", i) for i in range(3)]
        backwards = [("backward", i) for i in reversed(range(3))]
        assert ops == forwards + backwards


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize(("k", "v", "m"), VIRTUAL)
def test_virtual_stages_constraints_hold(
    k: int, v: int, m: int, checkpoint: str, schedule: str
) -> None:
    plan = virtual_plan(k, v, m, schedule, checkpoint, bandwidth=50.0, output=[20] * 2 * k * v)
    events = simulate(plan)
    check_schedule(plan, events)
    # Each device runs the operations of its rank's order, in that order.
    for r in range(k):
        ops = [
            ("F" if e.kind == "forward" else "B", e.stage, e.micro_batch)
            for e in events
            if e.stage % k == r and e.kind in ("forward", "backward")
        ]
        assert ops == rank_order(r, k, v, m, schedule)
    # No device can finish before it has done its own work.
    busy = [0.0] * k
    for e in events:
        busy[e.stage % k] += e.duration
    assert makespan(events) >= max(busy) * (1 - 1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize(("k", "v", "m"), VIRTUAL)
def test_virtual_stages_balanced_makespan_is_the_formula(
    k: int, v: int, m: int, schedule: str
) -> None:
    plan = make_plan([1] * (k * v), [1.0] * (k * v), chunks=m, schedule=schedule, virtual_stages=v)
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time)


def test_virtual_stages_must_divide_the_stages() -> None:
    plan = replace(make_plan([2, 2, 2]), virtual_stages=2)
    with pytest.raises(ValueError, match="3 stages do not divide into 2 per device"):
        simulate(plan)


@pytest.mark.parametrize(
    ("checkpoint", "schedule", "expected"),
    [
        ("always", "gpipe", [0, 1, 2, 3]),
        ("always", "1f1b", [0, 1, 2, 3]),
        # except_last spares the micro-batch whose backward comes first: GPipe goes
        # backward in reverse, 1F1B in order.
        ("except_last", "gpipe", [0, 1, 2]),
        ("except_last", "1f1b", [1, 2, 3]),
        ("never", "gpipe", []),
        ("never", "1f1b", []),
    ],
)
def test_recompute_exactly_for_checkpointed(
    checkpoint: str, expected: list[int], schedule: str
) -> None:
    plan = make_plan([2, 4], chunks=4, checkpoint=checkpoint, schedule=schedule)
    events = simulate(plan)
    for k in range(2):
        again = sorted(e.micro_batch for e in events if e.kind == "recompute" and e.stage == k)
        assert again == expected
    forward = {(e.stage, e.micro_batch): e.duration for e in events if e.kind == "forward"}
    for e in events:
        if e.kind == "recompute":
            assert e.duration == pytest.approx(forward[(e.stage, e.micro_batch)])


def test_except_last_single_micro_batch_recomputes_nothing() -> None:
    plan = make_plan([3, 3], chunks=1, checkpoint="except_last")
    assert not [e for e in simulate(plan) if e.kind == "recompute"]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_stage_times_add_up(checkpoint: str) -> None:
    plan = make_plan([1, 2, 3], checkpoint=checkpoint, bandwidth=50.0, output=[100] * 6)
    for t, stage in zip(stage_times(plan), plan.stages):
        assert t.total == pytest.approx(stage.time)
        assert t.backward == pytest.approx(2 * t.forward)  # linear_profile's default
        assert t.transfer == stage.transfer
    busy: dict[int, float] = defaultdict(float)
    for e in simulate(plan):
        busy[e.stage] += e.duration
    # Over a step each stage is busy M times its per-micro-batch cost.
    for stage in plan.stages:
        assert busy[stage.index] == pytest.approx(plan.chunks * stage.time)


def test_stage_times_follow_profile_ratio() -> None:
    profile = linear_profile([1.0, 3.0], backward=[1.0, 9.0], batch=8, chunks=2)
    plan = evaluate(profile, [1, 1], chunks=2, checkpoint="never")
    first, second = stage_times(plan)
    assert first.backward == pytest.approx(first.forward)
    assert second.backward == pytest.approx(3 * second.forward)


def test_plan_without_profile_splits_one_to_two() -> None:
    plan = replace(make_plan([2, 4], checkpoint="always"), profile={})
    for t, stage in zip(stage_times(plan), plan.stages):
        assert t.backward == pytest.approx(2 * t.forward)
        assert t.total == pytest.approx(stage.time)
    assert makespan(simulate(plan)) == pytest.approx(plan.step_time)


def test_saved_plan_simulates_the_same(tmp_path: Path) -> None:
    plan = make_plan([1, 2, 3], checkpoint="except_last", schedule="1f1b")
    plan.save(tmp_path / "plan.json")
    assert simulate(Plan.load(tmp_path / "plan.json")) == simulate(plan)


def test_unknown_schedule() -> None:
    plan = replace(make_plan([3, 3]), schedule="zigzag")
    with pytest.raises(ValueError, match="zigzag"):
        simulate(plan)


def test_makespan_of_nothing() -> None:
    assert makespan([]) == 0.0


def test_auto_plan_recomputes_only_on_checkpointed_stages() -> None:
    import numpy as np

    from autopipe import plan
    from tests.support.planning_cases import random_profile

    profile = random_profile(np.random.default_rng(0), 8)
    mixed = plan(profile, 2, checkpoint="auto", memory=8000)
    assert mixed.stage_checkpoints == ["never", "except_last"]
    recomputes = [e for e in simulate(mixed) if e.kind == "recompute"]
    assert {e.stage for e in recomputes} == {1}
    assert len(recomputes) == mixed.chunks - 1


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
def test_split_backward_recomputes_before_each_input_gradient(schedule: str) -> None:
    profile = linear_profile(
        [1.0, 2, 1, 3, 1, 2, 1, 1], saved=[100] * 8, params=[10] * 8, batch=8, chunks=8
    )
    options = {"schedule": schedule, "chunks": 8, "optimizer": "sgd"}
    kept = evaluate(profile, [2, 2, 2, 2], checkpoint="never", **options)
    again = evaluate(profile, [2, 2, 2, 2], checkpoint="always", **options)
    events = simulate(again)
    assert again.step_time == pytest.approx(makespan(events))
    assert again.step_time > kept.step_time
    # Every input gradient (or whole backward) of every stage re-runs the forward first,
    # on the same device, right before it; the weights' gradients do not.
    recomputes = {(e.stage, e.micro_batch): e for e in events if e.kind == "recompute"}
    backwards = [e for e in events if e.kind == "backward"]
    assert len(recomputes) == len(backwards) == 4 * 8
    for e in backwards:
        before = recomputes[e.stage, e.micro_batch]
        assert before.end == pytest.approx(e.start)
        assert before.duration == pytest.approx(again.stages[e.stage].forward)
    # The stage's time carries one more forward per micro-batch than without.
    for a, b in zip(again.stages, kept.stages, strict=True):
        assert a.compute == pytest.approx(b.compute + b.forward)
        assert a.weight == pytest.approx(b.weight)


@pytest.mark.parametrize("schedule", ["zb", "zbv"])
def test_recomputed_units_run_with_the_input_gradient(schedule: str) -> None:
    profile = uneven_profile()
    options = {"schedule": schedule, "chunks": 8, "optimizer": "sgd"}
    kept = evaluate(profile, [2, 2, 2, 2], checkpoint="never", **options)
    units = evaluate(profile, [2, 2, 2, 2], checkpoint="auto", memory=3000, **options)
    assert "units" in units.stage_checkpoints
    events = simulate(units)
    assert units.step_time == pytest.approx(makespan(events))
    for a, b in zip(units.stages, kept.stages, strict=True):
        # The units' forwards are added to the input gradient, none to the weights'.
        assert a.weight == pytest.approx(b.weight)
        assert a.compute - a.weight == pytest.approx(b.compute - b.weight + a.recompute)
