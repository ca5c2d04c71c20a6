"""Tests for torchgpipe's block partition heuristic (its package is the reference in
test_peer_strategies.py)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import PlanningError
from autopipe.planning.split.torchgpipe_split import blockpartition

costs_lists = st.lists(
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
    min_size=1,
    max_size=60,
)


def _sums(costs: list[float], balance: list[int]) -> list[float]:
    out, start = [], 0
    for count in balance:
        out.append(math.fsum(costs[start : start + count]))
        start += count
    return out


def _is_valid(balance: list[int], n: int, k: int) -> bool:
    return len(balance) == k and sum(balance) == n and all(c >= 1 for c in balance)


def _optimal_max(costs: list[float], k: int) -> float:
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(math.fsum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def _balance_or_refusal(costs: list[float], k: int) -> list[int] | None:
    try:
        return blockpartition(costs, k)
    except PlanningError as exc:
        assert "torchgpipe's blockpartition" in str(exc)
        return None


@settings(max_examples=300, deadline=None)
@given(costs=costs_lists, data=st.data())
def test_returns_valid_balance_or_refuses(costs: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(costs)))
    balance = _balance_or_refusal(costs, k)
    assert balance is None or _is_valid(balance, len(costs), k)


def test_not_optimal_on_known_instance() -> None:
    # Normalized, this is [0]*7 + [1]: the equal split already has spread 1, so the
    # heuristic stops at [4, 4] (20 | 35) although [6, 2] gives 30 | 25.
    costs = [5.0] * 7 + [20.0]
    balance = blockpartition(costs, 2)
    assert balance == [4, 4]
    assert max(_sums(costs, balance)) == 35
    assert _optimal_max(costs, 2) == 30


def test_finds_perfect_split_when_spread_is_large() -> None:
    assert blockpartition([1, 1, 1, 1, 10, 10], 2) == [5, 1]


@pytest.mark.parametrize(
    ("costs", "k"),
    [
        ([3.0] * 17, 5),
        ([0.0] * 9, 4),
        ([1e12] + [0.0] * 30, 7),
        ([0.0] * 30 + [1e12], 7),
        ([1.0] * 15 + [1e12] + [1.0] * 15, 8),
        ([0.0, 0.0, 1.0, 0.0, 0.0], 3),
        ([1e9] + [0.0] * 200 + [1e9], 64),
        ([0.0] * 200 + [1.0] * 200, 100),
        ([1e-300, 0.0, 1e-300, 0.0], 2),
        ([float(i % 2) * 1e15 for i in range(101)], 33),
        ([float(2**i) for i in range(40)], 10),
    ],
)
def test_ends_on_adversarial_inputs(costs: list[float], k: int) -> None:
    balance = _balance_or_refusal(costs, k)
    assert balance is None or _is_valid(balance, len(costs), k)


@pytest.mark.parametrize(
    ("costs", "k", "message"),
    [
        ([0, 0, 0, 100, 10, 0, 1, 10, 0, 1, 100], 10, "does not stop"),
        # Normalized [0, 0, 1, 1]: torchgpipe ends with the split [3, 0, 1].
        ([1.0, 1.0, 2.0, 2.0], 3, "leaves stage 1 empty"),
    ],
)
def test_refuses_what_torchgpipe_cannot_split(costs: list[float], k: int, message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        blockpartition(costs, k)


def test_all_equal_keeps_the_equal_count_start() -> None:
    # torchgpipe starts with n // k layers per stage and the rest on the last.
    assert blockpartition([2.5] * 10, 4) == [2, 2, 2, 4]
    assert blockpartition([1, 1, 1], 2) == [1, 2]
    assert blockpartition([1] * 7, 3) == [2, 2, 3]


def test_one_stage_and_one_layer_per_stage() -> None:
    assert blockpartition([4.0, 1.0, 7.0], 1) == [3]
    assert blockpartition([4.0, 1.0, 7.0], 3) == [1, 1, 1]
    assert blockpartition([0.0], 1) == [1]


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=9),
    data=st.data(),
)
def test_never_below_optimum(costs: list[int], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(costs)))
    floats = [float(c) for c in costs]
    balance = _balance_or_refusal(floats, k)
    assert balance is None or max(_sums(floats, balance)) >= _optimal_max(floats, k)


def test_accepts_ints_and_tuples() -> None:
    assert blockpartition((3, 1, 4, 1, 5, 9, 2, 6), 3) == blockpartition(
        [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 3
    )


@pytest.mark.parametrize(
    ("costs", "k", "message"),
    [
        ([1.0, 2.0], 0, "at least 1"),
        ([1.0, 2.0], 3, "cannot split 2 layers into 3"),
        ([], 1, "cannot split 0 layers"),
        ([1.0, -2.0], 1, "non-negative"),
        ([1.0, math.nan], 1, "non-negative and finite"),
        ([1.0, math.inf], 2, "non-negative and finite"),
    ],
)
def test_errors(costs: list[float], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        blockpartition(costs, k)
