"""The V schedules' replayed step: by hand for K = 2, M = 4 (and DualPipeV's overlapped
pairs for K = 1, M = 2), and against a separate event simulation for random stage times,
all-to-alls included."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.schedules.interleaving import in_flight, rank_order
from autopipe.planning.schedules.schedule_replay import hidden_seconds, makespans
from autopipe.planning.schedules.v_schedules import v_order, v_pairs, v_rank


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
    af, ab = times.get("af", 0 * f), times.get("ab", 0 * f)
    last = 2 * ranks - 1
    orders = [v_order(r, ranks, chunks, schedule) for r in range(ranks)]
    pairs = [v_pairs(r, ranks, chunks, schedule) for r in range(ranks)]

    def hidden(r: int, p: int) -> float:
        """What of position p's all-to-alls its pair hides: the pair's compute over its
        all-to-alls, at most all of them."""
        first = p if p in pairs[r] else p - 1
        if first not in pairs[r]:
            return 0.0
        (_, sf, _), (_, sb, _) = orders[r][first], orders[r][first + 1]
        talk = af[sf] + ab[sb]
        share = min(1.0, (f[sf] - af[sf] + b[sb] - ab[sb]) / talk) if talk else 0.0
        return share * (af[sf] if p == first else ab[sb])

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
            free[r] = start + took - hidden(r, pos[r])
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


def test_dualpipev_pairs_hide_their_all_to_alls_by_hand() -> None:
    # K = 1, M = 2: one rank runs F0.0 F1.0 F0.1 B1.0 (F1.1·B0.0 overlapped) B1.1 I0.1
    # W0.1, the last rank's first F0·B1 apart (torch runs it so).
    assert v_order(0, 1, 2, "dualpipev") == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 1, 0), ("F", 1, 1), ("B", 0, 0),
        ("B", 1, 1), ("I", 0, 1), ("W", 0, 1),
    ]  # fmt: skip
    assert v_pairs(0, 1, 2, "dualpipev") == {4}
    forward, backward = np.array([[2.0, 3.0]]), np.array([[4.0, 6.0]])
    comm = (np.array([[1.0, 2.0]]), np.array([[1.0, 3.0]]))
    args = (forward, backward, 0 * forward, np.zeros((1, 2), dtype=np.int64), 1, 2)
    weight = np.full((1, 2), 0.5)
    # Unpaired, everything in turn: 2·2 + 2·3 + 3·6 (two B1 and I0+W0) + 4 = 32 - 2 = 30.
    assert makespans(*args, "dualpipev", weight).tolist() == [30.0]
    # The pair F1.1·B0.0: compute (3 − 2) + (4 − 1) = 4, all-to-alls 2 + 1 = 3, so it takes
    # max(4, 3) = 4 instead of 7: 3 s hidden.
    assert makespans(*args, "dualpipev", weight, comm).tolist() == [27.0]
    assert hidden_seconds(forward, backward, *comm, 1, 2, "dualpipev").tolist() == [[3.0]]
    # All-to-alls outweighing the compute: (3 − 3) + (4 − 3) = 1 against 3 + 3 = 6, the
    # pair takes 6 instead of 7.
    heavy = (np.array([[1.0, 3.0]]), np.array([[3.0, 3.0]]))
    assert makespans(*args, "dualpipev", weight, heavy).tolist() == [29.0]
    # ZBV pairs nothing, whatever it is told of the all-to-alls.
    assert makespans(*args, "zbv", weight, comm).tolist() == makespans(*args, "zbv", weight)
    assert not hidden_seconds(forward, backward, *comm, 1, 2, "zbv").any()


@pytest.mark.parametrize(("ranks", "chunks"), [(1, 2), (2, 4), (2, 6), (3, 6), (3, 7), (4, 9)])
def test_dualpipev_replay_with_all_to_alls_equals_an_event_simulation(
    ranks: int, chunks: int
) -> None:
    rng = np.random.default_rng(ranks * 100 + chunks)
    stages = 2 * ranks
    codes = np.zeros((1, stages), dtype=np.int64)
    for _ in range(5):
        times = {
            "f": rng.integers(2, 9, stages).astype(float),
            "b": rng.integers(2, 9, stages).astype(float) * 2,
            "t": rng.integers(0, 3, stages).astype(float),
            "w": np.full(stages, 0.5),
        }
        times["t"][-1] = 0.0
        times["af"] = rng.integers(0, 3, stages) * times["f"] / 2
        times["ab"] = rng.integers(0, 3, stages) * times["b"] / 2
        parts = [times[k][None] for k in ("f", "b", "t")]
        comm = (times["af"][None], times["ab"][None])
        found = makespans(*parts, codes, ranks, chunks, "dualpipev", times["w"][None], comm)
        assert found[0] == pytest.approx(_simulated(times, ranks, chunks, "dualpipev"))
        plain = makespans(*parts, codes, ranks, chunks, "dualpipev", times["w"][None])
        assert found[0] <= plain[0]
        # No all-to-alls, no credit: the replay of before.
        zero = (0 * comm[0], 0 * comm[1])
        assert (
            makespans(*parts, codes, ranks, chunks, "dualpipev", times["w"][None], zero)[0]
            == plain[0]
        )
