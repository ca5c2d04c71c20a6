"""The public ``partition`` API: strategies, validation and infeasibility messages."""

from __future__ import annotations

import pytest

import autopipe
from autopipe import PlanningError, partition
from autopipe.planning.split.minmax import bottleneck


def test_exported_and_default_is_optimal():
    assert autopipe.partition is partition
    assert bottleneck([5] * 7 + [20], partition([5] * 7 + [20], 2)) == 30


@pytest.mark.parametrize("strategy", ["optimal", "uniform", "parameters", "blockpartition"])
def test_every_strategy_returns_a_valid_balance(strategy):
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    balance = partition(costs, 4, memory=costs, strategy=strategy)
    assert len(balance) == 4 and min(balance) >= 1 and sum(balance) == len(costs)


def test_strategies_differ_where_expected():
    costs = [5] * 7 + [20]
    assert bottleneck(costs, partition(costs, 2, strategy="blockpartition")) == 35
    assert bottleneck(costs, partition(costs, 2)) == 30
    assert partition(costs, 2, strategy="uniform") == [4, 4]
    assert partition([1] * 10, 3, strategy="uniform") == [4, 3, 3]


def test_memory_cap_per_stage_list():
    assert partition([1, 1, 1, 1], 2, memory=[5, 5, 1, 1], capacity=[5, 100]) == [1, 3]


def test_stages_greater_than_layers():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        partition([1, 2], 3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"costs": [], "stages": 1}, "non-empty"),
        ({"costs": [1, -1], "stages": 1}, "non-negative"),
        ({"costs": [1, 2], "stages": 0}, "positive integer"),
        ({"costs": [1, 2], "stages": 1, "memory": [1]}, "memory has 1 entries"),
        ({"costs": [1, 2], "stages": 2, "capacity": 3}, "capacity needs memory"),
        ({"costs": [1, 2], "stages": 2, "memory": [1, 1], "capacity": [1]}, "capacity has 1"),
        ({"costs": [1, 2], "stages": 1, "strategy": "magic"}, "unknown strategy"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        partition(**kwargs)


def test_single_layer_too_large_is_named_with_missing_bytes():
    with pytest.raises(PlanningError, match=r"layer 1 needs 50 bytes .* \(30 bytes missing\)"):
        partition([1, 1, 1], 2, memory=[1, 50, 1], capacity=20)


def test_no_split_fits_names_stage_and_bytes():
    with pytest.raises(PlanningError) as info:
        partition([1, 1, 1, 1], 2, memory=[10, 10, 10, 10], capacity=15)
    message = str(info.value)
    assert "no split into 2 stages fits" in message
    assert "5 more bytes on stage" in message


def test_baseline_strategy_that_does_not_fit_is_reported():
    with pytest.raises(PlanningError, match="stage 0 .* needs 10 more bytes"):
        partition([1, 1, 1, 1], 2, memory=[10, 10, 1, 1], capacity=10, strategy="uniform")


def test_capacity_takes_the_size_strings_plan_takes():
    costs, memory = [1, 1, 1, 1], [2**30] * 4
    assert partition(costs, 2, memory=memory, capacity="2GiB") == [2, 2]
    assert partition(costs, 2, memory=memory, capacity=["1GiB", 3 * 2**30]) == [1, 3]
    with pytest.raises(PlanningError):
        partition(costs, 2, memory=memory, capacity="1GiB")


@pytest.mark.parametrize(
    ("capacity", "error", "message"),
    [
        ("lots", ValueError, "cannot parse capacity size 'lots'"),
        ("1e999", ValueError, "capacity '1e999' is not a finite size"),
        (float("nan"), ValueError, "capacity must be non-negative, got nan"),
        ([None, 5], TypeError, "capacity must be bytes or a size such as 16GiB, got None"),
        ({"a": 1}, TypeError, "capacity must be a size such as 16GiB or one per stage"),
    ],
)
def test_bad_capacity(capacity, error, message):
    with pytest.raises(error, match=message):
        partition([1, 1, 1], 2, memory=[1, 1, 1], capacity=capacity)


def test_layer_memory_takes_sizes_but_costs_take_numbers():
    memory = ["1GiB", "1GiB", 2**30, "1GiB"]
    assert partition([1, 1, 1, 1], 2, memory=memory, capacity="2GiB") == [2, 2]
    # numpy would read these as 1.0 and 2.0.
    with pytest.raises(ValueError, match="costs must be a sequence of numbers, got '1'"):
        partition(["1", "2"], 1)
    with pytest.raises(ValueError, match="memory must be a sequence of numbers, got b'2'"):
        partition([1, 1], 1, memory=[1, b"2"])


def test_numbers_in_any_container_give_the_same_split_and_messages():
    # Sequences numpy reads as numbers skip the element-wise checks; the split and the
    # refusals are those of the array.
    import numpy as np

    costs = [3, 1.5, 4, True, 5, 9, 2, 6, 5, 3]
    expected = partition(np.array(costs, dtype=float), 3)
    assert partition(costs, 3) == partition(tuple(costs), 3) == expected
    for bad in ([1.0, float("nan")], (1, float("inf")), [1, -2.0]):
        with pytest.raises(ValueError, match="costs must be finite and non-negative"):
            partition(bad, 1)
    with pytest.raises(ValueError, match="costs must be a non-empty flat sequence"):
        partition([[1, 2], [3, 4]], 1)
    with pytest.raises(ValueError, match="costs must be a sequence of numbers$"):
        partition([1, [2, 3]], 1)
    with pytest.raises(ValueError, match="costs must be a sequence of numbers, got '2'"):
        partition([1.0, "2", 3.0], 1)
