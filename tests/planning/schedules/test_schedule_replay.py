"""Tests of the step replayed from a schedule's order, for many splits at once."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate
from autopipe.planning.schedules import schedule_replay
from autopipe.planning.schedules.interleaving import rank_order, spared
from autopipe.planning.schedules.schedule_replay import (
    ALL,
    ALL_BUT_ONE,
    NONE,
    RECOMPUTE_CODES,
    makespans,
    recomputes,
    replay_order,
)
from autopipe.planning.schedules.simulation import makespan, simulate, stage_times
from tests.support.planning_cases import linear_profile

# (K, v, M) that interleaved 1F1B accepts: M a multiple of its rounds' micro-batches.
SHAPES = [(1, 1, 3), (2, 1, 4), (3, 1, 2), (2, 2, 4), (2, 3, 2), (3, 2, 3), (2, 2, 1), (4, 2, 8)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb"])
@pytest.mark.parametrize(("k", "v", "m"), SHAPES)
def test_order_keeps_each_rank_order_and_puts_inputs_first(
    k: int, v: int, m: int, schedule: str
) -> None:
    order = replay_order(k, v, m, schedule)
    for r in range(k):
        ops = [(o.kind, o.stage, o.micro_batch) for o in order if o.rank == r]
        assert ops == rank_order(r, k, v, m, schedule)
    assert all(o.rank == o.stage % k for o in order)
    seen: set[tuple[str, int, int]] = set()
    last = k * v - 1
    for o in order:
        if o.kind == "F" and o.stage > 0:
            assert ("F", o.stage - 1, o.micro_batch) in seen
        elif o.kind == "W":  # the weights' gradients follow the input's, on this device
            assert ("I", o.stage, o.micro_batch) in seen
        elif o.kind in "BI" and o.stage == last:
            assert ("F", o.stage, o.micro_batch) in seen
        elif o.kind in "BI":
            assert (o.kind, o.stage + 1, o.micro_batch) in seen
        seen.add((o.kind, o.stage, o.micro_batch))
    assert len(seen) == len(order) == (3 if schedule == "zb" else 2) * k * v * m


def test_recompute_codes() -> None:
    assert RECOMPUTE_CODES == {"never": NONE, "always": ALL, "except_last": ALL_BUT_ONE}
    assert [recomputes(ALL_BUT_ONE, i, 2) for i in range(3)] == [True, True, False]
    assert [recomputes(ALL_BUT_ONE, i, 0) for i in range(3)] == [False, True, True]
    assert all(recomputes(ALL, i, 2) for i in range(3))
    assert not any(recomputes(NONE, i, 2) for i in range(3))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "v", "m"), SHAPES)
def test_the_spared_micro_batch_is_each_stage_first_backward(
    k: int, v: int, m: int, schedule: str
) -> None:
    first = spared(k, v, m, schedule)
    for stage in range(k * v):
        backwards = [
            o.micro_batch
            for o in replay_order(k, v, m, schedule)
            if o.stage == stage and not o.forward
        ]
        assert first[stage] == backwards[0]
    # GPipe's fill-drain and looped BFS go backward in reverse; 1F1B orders in order.
    assert set(first) == ({m - 1} if schedule == "gpipe" else {0})


PARTS = ("forward", "backward", "transfer")


def _random_plans(count: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    plans = []
    while len(plans) < count:
        k, v, m = rng.choice(SHAPES)
        layers = k * v + rng.randint(0, 4)
        forward = [rng.lognormvariate(0, 0.7) for _ in range(layers)]
        output = [rng.randint(1, 100) for _ in range(layers)]
        # Some layers without parameters: their backward has no weights' part.
        params = [rng.choice([0, 1000]) for _ in range(layers)]
        profile = linear_profile(forward, output=output, params=params, batch=4 * m, chunks=m)
        cuts = sorted(rng.sample(range(1, layers), k * v - 1))
        balance = [b - a for a, b in zip((0, *cuts), (*cuts, layers), strict=True)]
        schedule = rng.choice(["gpipe", "1f1b", "zb"])
        modes = ["never"] if schedule == "zb" else ["never", "always", "except_last"]
        plans.append(
            evaluate(
                profile,
                balance,
                chunks=m,
                schedule=schedule,
                checkpoint=rng.choice(modes),
                virtual_stages=v,
                bandwidth=rng.choice([None, 50.0]),
            )
        )
    return plans


def test_makespans_equal_the_simulation() -> None:
    for plan in _random_plans(120, seed=3):
        times = stage_times(plan)
        f, b, t = (np.array([[getattr(x, part) for x in times]]) for part in PARTS)
        codes = np.array([[RECOMPUTE_CODES[s.checkpoint] for s in plan.stages]])
        ranks = plan.num_stages // plan.virtual_stages
        weight = np.array([[x.weight / x.backward if x.backward else 0.0 for x in times]])
        got = makespans(f, b, t, codes, ranks, plan.chunks, plan.schedule, weight)
        assert got.shape == (1,)
        assert got[0] == pytest.approx(makespan(simulate(plan)))
        # The planner's step time is the same replay.
        if plan.virtual_stages > 1 or plan.schedule == "zb":
            assert plan.step_time == pytest.approx(got[0])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "dualpipev"])
@pytest.mark.parametrize(("k", "v", "m"), [(1, 1, 3), (3, 2, 6), (4, 2, 8)])
def test_program_reads_every_message_once_from_its_slot(
    k: int, v: int, m: int, schedule: str
) -> None:
    # Each forward output and input gradient is read once, by the operation waiting on it;
    # slots are reused only once read, so no read finds a message overwritten.
    if schedule == "dualpipev" and (v != 2 or m < 2 * k):
        return
    program, slots = schedule_replay.replay_program(k, v, m, schedule)
    order = replay_order(k, v, m, schedule)
    assert [(c, s, i, r) for c, s, i, r, _, _, _ in program] == [
        ("FWBI".index(o.kind), o.stage, o.micro_batch, o.rank) for o in order
    ]
    holder: dict[int, tuple[str, int, int]] = {}
    last = k * v - 1
    for code, s, i, _, read, write, _ in program:
        kind = "FWBI"[code]
        if kind == "F" and s > 0:
            assert holder.pop(read) == ("F", s - 1, i)
        elif kind in "BI":
            assert holder.pop(read) == (("F", s, i) if s == last else ("G", s + 1, i))
        if write >= 0:
            assert write not in holder and write < slots
            holder[write] = ("F" if kind == "F" else "G", s, i)
    assert slots < k * v * m or k * v * m <= 3


def _stage_times(
    rng: np.random.Generator, rows: int, stages: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random forward, backward and transfer seconds of ``rows`` splits (the last stage
    sends nothing); drawn in this order, as the tests' seeds expect."""
    f, b = rng.uniform(0.1, 2.0, (rows, stages)), rng.uniform(0.2, 4.0, (rows, stages))
    t = rng.uniform(0.0, 0.5, (rows, stages))
    t[:, -1] = 0.0
    return f, b, t


def test_rows_are_independent_and_blocks_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    k, v, m = 2, 2, 4
    f, b, t = _stage_times(rng, 50, k * v)
    codes = rng.integers(0, 3, (50, k * v))
    together = makespans(f, b, t, codes, k, m, "1f1b")
    alone = [makespans(f[i], b[i], t[i], codes[i], k, m, "1f1b")[0] for i in range(50)]
    assert together == pytest.approx(alone)
    _, slots = schedule_replay.replay_program(k, v, m, "1f1b")
    monkeypatch.setattr(schedule_replay, "_BLOCK_FLOATS", 3 * slots)  # blocks of 3 rows
    assert makespans(f, b, t, codes, k, m, "1f1b") == pytest.approx(together)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb", "dualpipev"])
def test_one_split_walks_to_the_same_bits_as_many(schedule: str) -> None:
    # One row takes the float walk, several the numpy one: the same step to the last bit.
    rng = np.random.default_rng(1)
    k, v, m = 3, 2, 6
    f, b, t = _stage_times(rng, 8, k * v)
    weight = rng.uniform(0.0, 1.0, (8, k * v))
    codes = rng.integers(0, 3, (8, k * v)) if schedule in ("gpipe", "1f1b") else 0 * t
    together = makespans(f, b, t, codes.astype(int), k, m, schedule, weight)
    for i in range(8):
        alone = makespans(f[i], b[i], t[i], codes[i].astype(int), k, m, schedule, weight[i])
        assert alone[0] == together[i]


@pytest.mark.parametrize(("k", "v", "m"), [s for s in SHAPES if s[0] > 1])
def test_balanced_stages_follow_the_closed_formula(k: int, v: int, m: int) -> None:
    # Stage cost c = f + b = 3, one stage per rank: Σc + (M−1)·c; M ≥ K: (M·v + K − 1)·c.
    stages = k * v
    ones = np.ones((1, stages))
    got = makespans(ones, 2 * ones, 0 * ones, np.zeros((1, stages), int), k, m, "1f1b")[0]
    expected = (v * max(m, k) + min(m, k) - 1) * 3.0
    assert got == pytest.approx(expected)


def test_stages_must_divide_among_ranks() -> None:
    ones = np.ones((1, 3))
    with pytest.raises(ValueError, match="3 stages do not divide among 2 ranks"):
        makespans(ones, ones, ones, np.zeros((1, 3), int), 2, 4, "gpipe")
    with pytest.raises(ValueError, match="unknown schedule"):
        makespans(ones, ones, ones, np.zeros((1, 3), int), 3, 4, "zigzag")


def test_every_split_in_one_call_matches_one_at_a_time() -> None:
    profile = linear_profile([1.0, 3.0, 2.0, 1.0, 2.5, 0.5, 1.5], batch=8, chunks=4)
    options = {"chunks": 4, "virtual_stages": 2, "schedule": "1f1b", "checkpoint": "except_last"}
    for cuts in itertools.combinations(range(1, 7), 3):
        balance = [b - a for a, b in zip((0, *cuts), (*cuts, 7), strict=True)]
        plan = evaluate(profile, balance, **options)
        assert plan.step_time == pytest.approx(makespan(simulate(plan)))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "v", "m"), SHAPES)
def test_a_slower_stage_never_shortens_the_step(k: int, v: int, m: int, schedule: str) -> None:
    # Max-plus: every end time is a max of sums of durations, so it only grows with them.
    rng = np.random.default_rng(k * 100 + v * 10 + m)
    stages = k * v
    f, b = rng.uniform(0.1, 2.0, (1, stages)), rng.uniform(0.2, 4.0, (1, stages))
    t = rng.uniform(0.0, 0.5, (1, stages))
    codes = rng.integers(0, 3, (1, stages))
    base = makespans(f, b, t, codes, k, m, schedule)[0]
    for s in range(stages):
        for part in range(3):
            times = [f.copy(), b.copy(), t.copy()]
            times[part][0, s] += 0.7
            assert makespans(*times, codes, k, m, schedule)[0] >= base - 1e-12
