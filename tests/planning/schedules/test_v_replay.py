"""The V schedules' replayed step: by hand for K = 2, M = 4, and against a separate
event simulation for random stage times."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.schedules.interleaving import in_flight, rank_order
from autopipe.planning.schedules.schedule_replay import makespans
from autopipe.planning.schedules.v_schedules import v_order, v_rank


def _unit(stages: int) -> tuple[np.ndarray, ...]:
    one = np.ones((1, stages))
    return one, 2 * one, 0 * one, np.zeros((1, stages), dtype=np.int64), 0.5 * one


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_balanced_k2_m4_by_hand(schedule: str) -> None:
    # F = I = W = 1 on 4 stages: each rank runs 2 stages × 4 micro-batches × 3 = 24 units.
    # Rank 1 waits one forward (stage 0's first) and from then on never idles; rank 0 ends
    # with I0.3 and W0.3 after rank 1's I1.3 (at 22), at 24. So the step is 1 + 24.
    forward, backward, transfer, codes, weight = _unit(4)
    found = makespans(forward, backward, transfer, codes, 2, 4, schedule, weight)
    assert found.tolist() == [25.0]


def _simulated(times: dict[str, np.ndarray], ranks: int, chunks: int, schedule: str) -> float:
    """Each rank takes its next operation once its input is done, sweeping until all are:
    written apart from the replay (no precomputed order across ranks)."""
    f, b, t, w = times["f"], times["b"], times["t"], times["w"]
    last = 2 * ranks - 1
    orders = [v_order(r, ranks, chunks, schedule) for r in range(ranks)]
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * ranks
    pos = [0] * ranks
    while any(p < len(o) for p, o in zip(pos, orders, strict=True)):
        moved = False
        for r in range(ranks):
            if pos[r] == len(orders[r]):
                continue
            op, s, i = orders[r][pos[r]]
            if op == "F":
                need = [("F", s - 1, i)] if s else []
                took = f[s] + t[s]
            elif op == "W":
                need = [("G", s, i)]
                took = b[s] * w[s]
            else:
                need = [("F", s, i)] if s == last else [("G", s + 1, i)]
                took = b[s] if op == "B" else b[s] * (1 - w[s])
            if any(n not in end for n in need):
                continue
            assert v_rank(s, ranks) == r
            start = max([free[r], *(end[n] for n in need)])
            free[r] = start + took
            end[("G" if op in "BI" else op, s, i)] = free[r]
            pos[r] += 1
            moved = True
        assert moved, "deadlock"
    return max(free)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize(("ranks", "chunks"), [(1, 2), (2, 4), (2, 6), (3, 6), (3, 7), (4, 9)])
def test_replay_equals_an_event_simulation(schedule: str, ranks: int, chunks: int) -> None:
    if schedule == "dualpipev" and chunks < 2 * ranks:
        pytest.skip("dualpipev needs 2K micro-batches")
    rng = np.random.default_rng(ranks * 10 + chunks)
    stages = 2 * ranks
    for _ in range(5):
        # Integer-valued float64 halves: sums are exact.
        times = {
            "f": rng.integers(1, 9, stages).astype(float),
            "b": rng.integers(1, 9, stages).astype(float) * 2,
            "t": rng.integers(0, 3, stages).astype(float),
            "w": np.full(stages, 0.5),
        }
        times["t"][-1] = 0.0
        found = makespans(
            times["f"][None],
            times["b"][None],
            times["t"][None],
            np.zeros((1, stages), dtype=np.int64),
            ranks,
            chunks,
            schedule,
            times["w"][None],
        )
        assert found[0] == _simulated(times, ranks, chunks, schedule)


def test_in_flight_counts_each_v_stage() -> None:
    # ZBV K = 2, M = 4: rank 0's stage 0 runs all four forwards before its first weight
    # pass; its stage 3 turns each micro-batch around at once (F, I, W in a row).
    assert in_flight(0, 2, 2, 4, "zbv") == [4, 1]
    assert in_flight(1, 2, 2, 4, "zbv") == [3, 2]


def test_v_schedules_refuse_other_virtual_counts() -> None:
    with pytest.raises(ValueError, match="2 stages per rank"):
        rank_order(0, 2, 3, 4, "zbv")
