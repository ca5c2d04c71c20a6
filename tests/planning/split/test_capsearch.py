"""The branch and bounds over caps (autopipe.planning.split.capsearch) against every split."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autopipe.planning.split.capsearch import minimize_over_caps, minimize_step
from tests.support.planning_cases import splits


def _stage_sums(values: list[int], balance: list[int]) -> list[int]:
    bounds = np.cumsum([0, *balance])
    return [sum(values[a:b]) for a, b in itertools.pairwise(bounds)]


def _cases(count: int, seed: int) -> list[tuple[list[int], list[int], int]]:
    """Integer stage costs and parameter bytes (exact sums), and a number of stages."""
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(count):
        n = int(rng.integers(2, 9))
        costs = [int(c) for c in rng.integers(1, 20, n)]
        params = [int(p) for p in rng.integers(0, 50, n)]
        cases.append((costs, params, int(rng.integers(1, n + 1))))
    return cases


def _step(costs: list[int], balance: list[int], chunks: int) -> int:
    sums = _stage_sums(costs, balance)
    return sum(sums) + (chunks - 1) * max(sums)


def _sum_under(costs: list[int], stages: int):
    """``solve(B)``: the split of least Σ c whose stages all cost at most B, by brute force."""

    def solve(limit: float) -> tuple[float, float, list[int]]:
        fitting = [
            (sum(sums), max(sums), balance)
            for balance in splits(len(costs), stages)
            if max(sums := _stage_sums(costs, balance)) <= limit
        ]
        return min(fitting, key=lambda found: found[:2])

    return solve


@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
def test_minimize_step_finds_the_least_step_of_every_split(chunks: int) -> None:
    for costs, _, stages in _cases(40, seed=chunks):
        bottleneck = min(max(_stage_sums(costs, b)) for b in splits(len(costs), stages))
        value, balance = minimize_step(chunks, bottleneck, _sum_under(costs, stages))
        best = min(_step(costs, b, chunks) for b in splits(len(costs), stages))
        assert value == best
        assert _step(costs, balance, chunks) == value


def test_minimize_step_with_one_micro_batch_is_the_least_sum() -> None:
    calls: list[float] = []
    solve = _sum_under([4, 1, 1, 4], 2)

    def counted(limit: float) -> tuple[float, float, list[int]]:
        calls.append(limit)
        return solve(limit)

    assert minimize_step(1, 5.0, counted) == (10, [2, 2])  # every split sums to 10
    assert calls == [math.inf]  # Σ c alone: no bound is needed


def _capped(costs: list[int], params: list[int], stages: int, chunks: int):
    """``solve(cap, limit)``: the least step among splits whose stages hold at most ``cap``
    parameter bytes, the largest stage's bytes of that split, and the split."""

    def solve(cap: float, limit: float) -> tuple[float, float, list[int]] | None:
        fitting = [
            (_step(costs, balance, chunks), max(_stage_sums(params, balance)), balance)
            for balance in splits(len(costs), stages)
            if max(_stage_sums(params, balance)) <= cap
        ]
        return min(fitting, key=lambda found: found[:2]) if fitting else None

    return solve


@pytest.mark.parametrize("alpha", [0.0, 0.1, 1.0, 5.0])
def test_minimize_over_caps_finds_the_least_step_plus_allreduce(alpha: float) -> None:
    for costs, params, stages in _cases(40, seed=int(10 * alpha)):
        chunks = 3
        floor = max(sum(params) / stages, max(params))
        result = minimize_over_caps(_capped(costs, params, stages, chunks), alpha, floor)
        assert result is not None
        best = min(
            _step(costs, b, chunks) + alpha * max(_stage_sums(params, b))
            for b in splits(len(costs), stages)
        )
        assert result.value == pytest.approx(best, rel=1e-12)
        assert result.bound == result.value  # solved to the end: the bound is the optimum
        split_value = _step(costs, result.split, chunks)
        assert split_value + alpha * max(_stage_sums(params, result.split)) == result.value


def test_minimize_over_caps_when_nothing_fits_is_none() -> None:
    assert minimize_over_caps(lambda cap, limit: None, 1.0, 0.0) is None


def test_minimize_over_caps_out_of_budget_bounds_the_optimum() -> None:
    # Costs that reward a small cap: the more a stage holds, the faster the pipeline.
    costs, params, stages, chunks = [9, 1, 1, 9, 1, 1], [30, 1, 1, 30, 1, 1], 3, 4
    solve = _capped(costs, params, stages, chunks)
    floor = max(sum(params) / stages, max(params))
    full = minimize_over_caps(solve, 0.5, floor)
    cut = minimize_over_caps(solve, 0.5, floor, max_solves=0)
    assert full is not None and cut is not None
    assert cut.bound <= full.value <= cut.value


def test_minimize_over_caps_drops_what_cannot_beat_stop() -> None:
    costs, params, stages, chunks = [5, 3, 8, 2, 7], [10, 40, 5, 25, 15], 3, 2
    solve = _capped(costs, params, stages, chunks)
    floor = max(sum(params) / stages, max(params))
    full = minimize_over_caps(solve, 1.0, floor)
    assert full is not None
    stopped = minimize_over_caps(solve, 1.0, floor, stop=full.value - 1)
    assert stopped is not None
    # The optimum is past ``stop``: what comes back is a split that fits and a lower bound.
    assert stopped.value >= full.value and stopped.bound <= full.value
