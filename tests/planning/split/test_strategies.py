"""Tests for DeepSpeed's strategies: uniform layer counts and parameter balancing (its package
is the reference in test_peer_strategies.py)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planning.split.strategies import parameters, uniform
from tests.support.planning_cases import splits


def _stage_sums(weights: list[float], balance: list[int]) -> list[float]:
    out, start = [], 0
    for count in balance:
        out.append(sum(weights[start : start + count]))
        start += count
    return out


@pytest.mark.parametrize(
    ("n", "k", "expected"),
    [
        (10, 4, [3, 3, 2, 2]),
        (8, 4, [2, 2, 2, 2]),
        (7, 3, [3, 2, 2]),
        (5, 5, [1, 1, 1, 1, 1]),
        (5, 1, [5]),
        (13, 5, [3, 3, 3, 2, 2]),
    ],
)
def test_uniform_places_remainder_first(n: int, k: int, expected: list[int]) -> None:
    assert uniform(n, k) == expected


@given(n=st.integers(min_value=1, max_value=500), data=st.data())
def test_uniform_is_valid_and_even(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=n))
    balance = uniform(n, k)
    assert len(balance) == k and sum(balance) == n
    assert max(balance) - min(balance) <= 1
    assert balance == sorted(balance, reverse=True)


@pytest.mark.parametrize(
    ("n", "k", "message"),
    [
        (4, 0, "at least 1"),
        (4, -1, "at least 1"),
        (4, 5, "cannot split 4 layers into 5"),
        (0, 1, "cannot split 0 layers"),
    ],
)
def test_uniform_errors(n: int, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        uniform(n, k)


@settings(max_examples=300, deadline=None)
@given(
    params=st.lists(st.integers(min_value=0, max_value=1000), min_size=1, max_size=9),
    data=st.data(),
)
def test_parameters_spread_no_worse_than_the_even_start(
    params: list[int], data: st.DataObject
) -> None:
    # DeepSpeed's program minimizes the spread (largest block minus smallest) prefix by
    # prefix: never above the spread of the best split, nor below it.
    k = data.draw(st.integers(min_value=1, max_value=len(params)))
    weights = [float(p) for p in params]
    balance = parameters(weights, k)
    assert len(balance) == k and sum(balance) == len(params) and min(balance) >= 1
    spreads = [
        max(_stage_sums(weights, s)) - min(_stage_sums(weights, s)) for s in splits(len(params), k)
    ]
    sums = _stage_sums(weights, balance)
    assert max(sums) - min(sums) >= min(spreads)


@settings(max_examples=200, deadline=None)
@given(
    params=st.lists(
        st.floats(min_value=0, max_value=1e10, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=40,
    ),
    data=st.data(),
)
def test_parameters_valid_for_float_inputs(params: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=1, max_value=len(params)))
    balance = parameters(params, k)
    assert len(balance) == k and sum(balance) == len(params) and min(balance) >= 1


def test_parameters_is_deepspeeds_not_the_min_max() -> None:
    # DeepSpeed's split [6] [5] [9, 3] (largest 12) where [6, 5] [9] [3] holds 11.
    assert parameters([6, 5, 9, 3], 3) == [1, 1, 2]
    # The last start of least spread wins: parameter-free layers pile onto the first stage.
    assert parameters([0.0] * 10, 4) == [7, 1, 1, 1]
    assert parameters([0, 0, 0, 100, 0, 0, 0], 2) == [6, 1]


def test_parameters_power_of_two_scale_changes_nothing() -> None:
    # Bytes of one dtype are the counts times 2 or 4: the same choices.
    counts = [8, 1, 1, 3, 1, 1, 0, 1, 1, 4]
    for k in range(1, len(counts) + 1):
        assert parameters([4 * c for c in counts], k) == parameters(counts, k)


def test_parameters_edge_stage_counts() -> None:
    assert parameters([5, 1, 2], 1) == [3]
    assert parameters([5, 1, 2], 3) == [1, 1, 1]


@pytest.mark.parametrize(
    ("params", "k", "message"),
    [
        ([1.0, 2.0], 0, "at least 1"),
        ([1.0, 2.0], 3, "cannot split 2 layers into 3"),
        ([], 1, "cannot split 0 layers"),
        ([1.0, -1.0], 1, "non-negative"),
        ([1.0, math.nan], 2, "non-negative and finite"),
        ([math.inf, 1.0], 2, "non-negative and finite"),
    ],
)
def test_parameters_errors(params: list[float], k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parameters(params, k)
