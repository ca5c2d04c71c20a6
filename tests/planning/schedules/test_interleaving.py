"""Virtual stages: interleaved step time, per-stage micro-batches in flight, planning."""

from __future__ import annotations

import itertools
import random
import re

import pytest

from autopipe import PlanningError
from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate, plan
from autopipe.planning.schedules.interleaving import (
    held_shares,
    in_flight,
    rank_order,
    rank_stages,
    rank_times,
    step_time,
)
from autopipe.planning.schedules.simulation import makespan, simulate
from autopipe.planning.split.exact import gpipe_step_time
from tests.support.planning_cases import linear_profile


def test_one_stage_per_rank_is_gpipe_formula() -> None:
    rng = random.Random(0)
    for _ in range(200):
        k, m = rng.randint(1, 6), rng.randint(1, 12)
        times = [rng.uniform(0.1, 3.0) for _ in range(k)]
        assert step_time(times, k, m) == pytest.approx(gpipe_step_time(times, m))


@pytest.mark.parametrize(("k", "v", "m"), list(itertools.product([1, 2, 4], [1, 2, 3], [1, 4, 8])))
def test_balanced_stages_shrink_the_bubble_v_fold(k: int, v: int, m: int) -> None:
    c = 0.5  # each of the K·v stages, per micro-batch
    per_rank = v * c
    assert step_time([c] * (k * v), k, m) == pytest.approx((m + (k - 1) / v) * per_rank)


def test_ranks_hold_looped_stages() -> None:
    assert rank_stages(1, 3, 2) == [1, 4]
    assert rank_times([1.0, 2.0, 3.0, 4.0], 2) == [4.0, 6.0]
    with pytest.raises(ValueError, match="5 stages do not divide among 2 ranks"):
        step_time([1.0] * 5, 2, 4)


def test_in_flight_without_virtual_stages_matches_the_schedules() -> None:
    for k, m in itertools.product(range(1, 6), range(1, 10)):
        for r in range(k):
            assert in_flight(r, k, 1, m, "1f1b") == [min(m, k - r)]
            assert in_flight(r, k, 1, m, "gpipe") == [m]
    assert in_flight(0, 2, 3, 5, "gpipe") == [5, 5, 5]  # looped BFS: every forward first


def _torch_order(rank: int, k: int, v: int, m: int, schedule: str) -> list[tuple[str, int, int]]:
    """Torch's own ScheduleInterleaved1F1B / ScheduleLoopedBFS order for one rank."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        ScheduleLoopedBFS,
        _ComputationType,
    )

    kind = ScheduleInterleaved1F1B if schedule == "1f1b" else ScheduleLoopedBFS
    torch_schedule = object.__new__(kind)  # its order needs no process group
    torch_schedule.n_local_stages, torch_schedule.pp_group_size = v, k
    torch_schedule._n_microbatches, torch_schedule._stages = m, [None] * v
    torch_schedule.number_of_rounds = max(1, m // k)
    torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
    return [
        (
            "F" if action.computation_type == _ComputationType.FORWARD else "B",
            action.stage_index,
            action.microbatch_index,
        )
        for action in torch_schedule._calculate_single_rank_operations(rank)
        if action is not None
    ]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize(("k", "v"), [(2, 2), (2, 3), (3, 2), (4, 2), (4, 4)])
def test_virtual_stage_orders_replay_torch(k: int, v: int, schedule: str) -> None:
    for m in range(1, 3 * k + 1):
        per_round = m // max(1, m // k)
        if schedule == "1f1b" and m % per_round:
            with pytest.raises(ValueError, match="multiple of"):
                in_flight(0, k, v, m, schedule)
            continue
        for r in range(k):
            order = _torch_order(r, k, v, m, schedule)
            assert rank_order(r, k, v, m, schedule) == order, (r, m)
            held, peak = [0] * v, [0] * v
            for op, stage, _ in order:
                held[stage // k] += 1 if op == "F" else -1
                peak[stage // k] = max(peak[stage // k], held[stage // k])
            assert held == [0] * v
            assert in_flight(r, k, v, m, schedule) == peak, (r, m)


def _profile() -> object:
    return linear_profile(
        [1.0, 2.0, 1.5, 1.0, 2.5, 1.0, 0.5, 1.5],
        saved=[100] * 8,
        output=[10] * 8,
        params=[1000] * 8,
        batch=8,
        chunks=4,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_plan_with_virtual_stages(schedule: str) -> None:
    profile = _profile()
    result = plan(profile, 4, chunks=4, schedule=schedule, virtual_stages=2, checkpoint="never")
    assert result.virtual_stages == 2 and result.num_stages == 4 and result.num_devices == 2
    # The step is the schedule's order replayed with the stages' times, as simulated.
    assert result.step_time == pytest.approx(makespan(simulate(result)))
    times = [stage.time for stage in result.stages]
    assert result.step_time >= 4 * max(rank_times(times, 2)) * (1 - 1e-12)
    # Every stage holds the micro-batches its rank's schedule keeps in flight.
    for stage in result.stages:
        expected = in_flight(stage.index % 2, 2, 2, 4, schedule)[stage.index // 2]
        assert stage.in_flight == expected
    again = Plan.from_dict(result.to_dict())
    assert again.virtual_stages == 2 and again.step_time == result.step_time
    same = evaluate(profile, result.balance, chunks=4, schedule=schedule, virtual_stages=2)
    assert same.virtual_stages == 2
    # Two ranks do the work of four devices: never faster than the stages on four.
    flat = evaluate(profile, result.balance, chunks=4, schedule=schedule, checkpoint="never")
    assert result.step_time >= flat.step_time * (1 - 1e-12)


def _replayed_peak(rank: int, k: int, v: int, m: int, schedule: str, sizes: list[float]) -> float:
    """The most a rank holds at once, replaying its order op by op: each of its stages
    holds ``sizes[j]`` per micro-batch from its forward to its (weights') backward."""
    local = {s: j for j, s in enumerate(rank_stages(rank, k, v, schedule))}
    held = [0] * v
    peak = 0.0
    for op, stage, _ in rank_order(rank, k, v, m, schedule):
        held[local[stage]] += {"F": 1, "B": -1, "W": -1}.get(op, 0)
        peak = max(peak, sum(h * size for h, size in zip(held, sizes, strict=True)))
    return peak


@pytest.mark.parametrize(
    ("k", "v", "m", "schedule"),
    [(2, 2, 4, "1f1b"), (4, 2, 8, "1f1b"), (4, 3, 8, "1f1b"), (8, 5, 64, "1f1b"),
     (4, 2, 8, "gpipe"), (3, 2, 6, "zb"), (4, 2, 8, "zbv"), (4, 2, 8, "dualpipev")],
)  # fmt: skip
def test_held_shares_give_the_replayed_peak(k: int, v: int, m: int, schedule: str) -> None:
    rng = random.Random(k * 100 + v * 10 + m)
    for rank in range(k):
        peaks = in_flight(rank, k, v, m, schedule)
        shares = held_shares(rank, k, v, m, schedule)
        for _ in range(20):
            sizes = [rng.uniform(0.1, 10.0) for _ in range(v)]
            stage_peaks = [n * size for n, size in zip(peaks, sizes, strict=True)]
            held = max(float(row @ stage_peaks) for row in shares)
            assert held == pytest.approx(_replayed_peak(rank, k, v, m, schedule, sizes))
            assert held <= sum(stage_peaks) * (1 + 1e-12)


def test_a_rank_holds_less_than_its_stages_peaks_under_interleaved_1f1b() -> None:
    # Rank 0 of 8 with 5 stages each, 64 micro-batches (Megatron's Llama 3 70B mesh):
    # its first three stages peak together after the warm-up, the last two later, at half.
    assert in_flight(0, 8, 5, 64, "1f1b") == [16, 16, 15, 8, 8]
    profile = linear_profile([1.0] * 16, saved=[100] * 16, params=[1] * 16, batch=8, chunks=8)
    result = plan(profile, 8, chunks=8, virtual_stages=2, checkpoint="never", schedule="1f1b")
    summed = [sum(result.stages[s].memory for s in rank_stages(r, 4, 2)) for r in range(4)]
    assert len(result.device_memory) == 4
    assert all(m <= s for m, s in zip(result.device_memory, summed, strict=True))
    assert any(m < s for m, s in zip(result.device_memory, summed, strict=True))
    assert Plan.from_dict(result.to_dict()).device_memory == result.device_memory


def test_a_rank_whose_stages_do_not_fit_is_named() -> None:
    # Identical layers, memory almost all parameters: any rank holds about half of it.
    profile = linear_profile([1.0] * 8, saved=[1] * 8, params=[10_000] * 8, batch=8, chunks=4)
    options = {"chunks": 4, "virtual_stages": 2, "checkpoint": "never", "schedule": "gpipe"}
    free = plan(profile, 4, **options)
    stage = max(s.memory for s in free.stages)
    total = sum(s.memory for s in free.stages)
    limit = int(1.2 * stage)  # each stage fits alone, but no rank holds half the total
    assert stage < limit < total / 2
    with pytest.raises(PlanningError, match=r"rank \d holds stages \[\d, \d\], which need"):
        plan(profile, 4, memory=limit, strategy="uniform", **options)
    # Optimal: every split tried; the refusal says which rank of the best one is over.
    with pytest.raises(PlanningError, match="no split into 4 stages, 2 per device, fits") as found:
        plan(profile, 4, memory=limit, **options)
    assert re.search(
        r"but rank \d holds stages \[\d, \d\], which need [\d.]+ \w?i?B more", str(found.value)
    )
    # Where even one stage is over its device alone, the stage and the bytes are named.
    with pytest.raises(PlanningError, match=r"2 per device, fits memory: even the best split"):
        plan(profile, 4, memory=int(0.5 * stage), **options)


def test_stages_must_divide_among_ranks() -> None:
    with pytest.raises(ValueError, match="3 stages do not split into 2 virtual stages"):
        plan(_profile(), 3, chunks=4, virtual_stages=2)


def test_virtual_stages_plan_with_their_own_runner_overhead() -> None:
    from profiler.calibrate import store_calibration

    profile = _profile()
    store_calibration(profile, overhead_s=0.25, virtual_overhead_s=1.5)  # type: ignore[arg-type]
    options = {"chunks": 4, "checkpoint": "never", "schedule": "1f1b"}
    virtual = plan(profile, 4, virtual_stages=2, **options)
    assert [s.overhead for s in virtual.stages] == [1.5] * 4
    assert [s.overhead for s in plan(profile, 4, **options).stages] == [0.25] * 4
    # Zero bubble runs on the multi-stage runtime even with one stage per rank.
    zero_bubble = plan(profile, 4, chunks=4, checkpoint="never", schedule="zb")
    assert [s.overhead for s in zero_bubble.stages] == [1.5] * 4
    store_calibration(profile, virtual_overhead_s=None)  # type: ignore[arg-type]
    assert plan(profile, 4, virtual_stages=2, **options).stages[0].overhead == 0.25


def _torch_zero_bubble(rank: int, k: int, v: int, m: int) -> list[tuple[str, int, int]]:
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleavedZeroBubble,
        _ComputationType,
    )

    names = {
        _ComputationType.FORWARD: "F",
        _ComputationType.BACKWARD_INPUT: "I",
        _ComputationType.BACKWARD_WEIGHT: "W",
    }
    torch_schedule = object.__new__(ScheduleInterleavedZeroBubble)  # no process group needed
    torch_schedule.n_local_stages, torch_schedule.pp_group_size = v, k
    torch_schedule._n_microbatches = m
    torch_schedule.number_of_rounds = max(1, m // k)
    torch_schedule.microbatches_per_round = m // torch_schedule.number_of_rounds
    return [
        (names[a.computation_type], a.stage_index, a.microbatch_index)
        for a in torch_schedule._calculate_single_rank_operations(rank)
        if a is not None
    ]


@pytest.mark.parametrize(("k", "v"), [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (2, 3), (4, 2)])
def test_zero_bubble_order_replays_torch(k: int, v: int) -> None:
    for m in range(1, 3 * k + 1):
        if m % (m // max(1, m // k)):
            with pytest.raises(ValueError, match="multiple of"):
                rank_order(0, k, v, m, "zb")
            continue
        for r in range(k):
            order = rank_order(r, k, v, m, "zb")
            assert order == _torch_zero_bubble(r, k, v, m), (r, m)
            # Activations stay until the weights' gradients: F to W.
            held, peak = [0] * v, [0] * v
            for op, stage, _ in order:
                held[stage // k] += {"F": 1, "W": -1}.get(op, 0)
                peak[stage // k] = max(peak[stage // k], held[stage // k])
            assert in_flight(r, k, v, m, "zb") == peak


@pytest.mark.parametrize("v", [1, 2])
def test_zero_bubble_plans_replay_their_schedule(v: int) -> None:
    profile = _profile()
    options = {"chunks": 4, "virtual_stages": v, "checkpoint": "never"}
    zb = plan(profile, 2 * v, schedule="zb", **options)
    assert zb.step_time == pytest.approx(makespan(simulate(zb)))
    # The deferred weight gradients fill the bubble: never slower than 1F1B's split.
    same = evaluate(profile, zb.balance, schedule="1f1b", **options)
    assert zb.step_time <= same.step_time * (1 + 1e-9)
    assert all(0 < s.weight < s.compute for s in zb.stages)  # every layer has parameters
    events = simulate(zb)
    assert sum(e.kind == "weight" for e in events) == 4 * 2 * v
    with pytest.raises(ValueError, match="except_last .* has no clear meaning"):
        plan(profile, 2, chunks=4, schedule="zb", checkpoint="except_last")
