"""Split backward with re-computation: the counts of the replayed order against a walk
that follows every micro-batch's bytes, and the peaks the planner derives from them."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from autopipe.planning import evaluate
from autopipe.planning.schedules.interleaving import (
    in_flight,
    rank_order,
    rank_stages,
    stage_placement,
)
from autopipe.planning.schedules.split_holding import split_moments, stage_holdings
from tests.support.planning_cases import uneven_profile

CASES = [
    *((s, k, 2, m) for s in ("zbv", "dualpipev") for k in (1, 2, 3, 4) for m in (2 * k, 2 * k + 3)),
    *(("zb", k, v, m) for k, v, m in itertools.product((1, 2, 3), (1, 2), (3, 6))),
]


def _walk(
    rank: int, ranks: int, virtual: int, chunks: int, schedule: str, bytes_: dict[int, tuple]
) -> float:
    """The most bytes ``rank`` holds at any moment: each micro-batch of each stage keeps
    ``a`` from its forward to its I (or B), ``a + b`` while that pass re-builds its set
    (``b`` alone where nothing is re-computed), ``b`` until its W; ``bytes_[stage]`` is
    ``(a, b, recomputed)``."""
    state: dict[tuple[int, int], float] = {}
    peak = 0.0
    for op, stage, i in rank_order(rank, ranks, virtual, chunks, schedule):
        a, b, again = bytes_[stage]
        if op == "F":
            state[stage, i] = a
        elif op in ("I", "B"):
            state[stage, i] = a + b if again else b  # the checkpoint and the re-built set
        peak = max(peak, sum(state.values()))
        if op == "W" or op == "B":
            state.pop((stage, i))
        elif op == "I":
            state[stage, i] = b
    return peak


@pytest.mark.parametrize(("schedule", "ranks", "virtual", "chunks"), CASES)
def test_moments_give_the_walked_peak_of_every_rank(
    schedule: str, ranks: int, virtual: int, chunks: int
) -> None:
    rng = random.Random(ranks * 100 + chunks)
    for rank in range(ranks):
        stages = rank_stages(rank, ranks, virtual, schedule)
        rows = split_moments(rank, ranks, virtual, chunks, schedule).astype(float)
        for _ in range(20):
            bytes_ = {}
            values = []
            for stage in stages:
                b = rng.choice([0.0, 1.0, 7.0, 100.0])
                again = rng.random() < 0.7
                a = rng.uniform(0, 1.5 * b) if again else b  # a > b: re-computing that loses
                bytes_[stage] = (a, b, again)
                values += [a, b, a if again else 0.0]
            walked = _walk(rank, ranks, virtual, chunks, schedule, bytes_)
            assert float((rows @ np.array(values)).max()) == pytest.approx(walked, abs=1e-9)


@pytest.mark.parametrize(("schedule", "ranks", "virtual", "chunks"), CASES)
def test_a_stage_alone_peaks_at_its_pairs_and_keeps_in_flight_without_recomputing(
    schedule: str, ranks: int, virtual: int, chunks: int
) -> None:
    for rank in range(ranks):
        stages = rank_stages(rank, ranks, virtual, schedule)
        pairs = stage_holdings(rank, ranks, virtual, chunks, schedule)
        counts = in_flight(rank, ranks, virtual, chunks, schedule)
        for j, stage in enumerate(stages):
            others = {s: (0.0, 0.0, False) for s in stages if s != stage}
            for a, b in ((1.0, 10.0), (3.0, 4.0), (0.0, 1.0)):
                walked = _walk(
                    rank, ranks, virtual, chunks, schedule, {**others, stage: (a, b, True)}
                )
                assert max(c * a + y * b for c, y in pairs[j]) == pytest.approx(walked)
            kept = _walk(
                rank, ranks, virtual, chunks, schedule, {**others, stage: (5.0, 5.0, False)}
            )
            assert kept == pytest.approx(5.0 * counts[j])


def test_the_first_zbv_stage_keeps_every_micro_batch_but_re_computed_only_inputs() -> None:
    # Rank 0's first stage runs every forward before its first input gradient.
    assert in_flight(0, 3, 2, 6, "zbv")[0] == 6
    assert stage_holdings(0, 3, 2, 6, "zbv")[0] == ((6, 1),)


PROFILE = uneven_profile(input_bytes=40)


@pytest.mark.parametrize("schedule", ["zb", "zbv", "dualpipev"])
@pytest.mark.parametrize(
    ("checkpoint", "memory"), [("always", None), ("auto", 3000), ("never", None)]
)
def test_planned_stage_and_device_peaks_are_the_walked_ones(
    schedule: str, checkpoint: str, memory: int | None
) -> None:
    virtual = 2 if schedule == "zb" else 1  # zb: 3 ranks of 2 stages; V: 2 ranks of 2
    balance = [1, 2, 1, 2, 1, 1] if schedule == "zb" else [2, 2, 3, 1]
    made = evaluate(
        PROFILE,
        balance,
        schedule=schedule,
        chunks=8,
        checkpoint=checkpoint,
        optimizer="sgd",
        virtual_stages=virtual,
        memory=memory,
    )
    ranks = len(balance) // 2
    placement = stage_placement(len(balance), ranks, schedule)
    inputs, saved = [40, 50, 120, 30, 90, 60, 80, 20], [400, 900, 300, 800, 500, 700, 200, 600]
    micro: dict[int, tuple[float, float, bool]] = {}
    for stage in made.stages:
        s, e = stage.start, stage.stop
        full = float(sum(saved[s:e]))
        if stage.checkpoint == "always":
            micro[stage.index] = (float(inputs[s]), full, True)
        elif stage.checkpoint == "units":
            units = stage.recompute_units
            micro[stage.index] = (full - sum(saved[u] - inputs[u] for u in units), full, True)
        else:
            micro[stage.index] = (full, full, False)
        alone = {j: (0.0, 0.0, False) for j in range(len(balance))}
        alone[stage.index] = micro[stage.index]
        walked = _walk(placement[stage.index], ranks, 2, 8, schedule, alone)
        assert stage.activation_memory == pytest.approx(walked)
    if checkpoint != "auto":
        assert {s.checkpoint for s in made.stages} == {checkpoint}
    for r in range(ranks):
        state = sum(s.param_memory for s in made.stages if placement[s.index] == r)
        held = _walk(r, ranks, 2, 8, schedule, micro)
        assert made.device_memory[r] == pytest.approx(state + held)
    if checkpoint == "auto":  # the cap makes some stage re-compute
        assert any(s.checkpoint != "never" for s in made.stages)
