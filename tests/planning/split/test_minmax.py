"""The exact min-max partitioner against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planning.split.minmax import bottleneck, minmax_partition
from tests.support.planning_cases import splits


def brute_force(costs, stages, memory=None, caps=None):
    best = None
    for balance in splits(len(costs), stages):
        if memory is not None:
            bounds = np.cumsum([0, *balance])
            used = [sum(memory[a:b]) for a, b in itertools.pairwise(bounds)]
            if any(u > c for u, c in zip(used, caps)):
                continue
        value = bottleneck(costs, balance)
        best = value if best is None else min(best, value)
    return best


@st.composite
def instances(draw, with_memory):
    n = draw(st.integers(1, 9))
    stages = draw(st.integers(1, n))
    costs = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    if not with_memory:
        return costs, stages, None, None
    memory = draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))
    caps = draw(st.lists(st.integers(0, 60), min_size=stages, max_size=stages))
    return costs, stages, memory, caps


def check(costs, stages, memory, caps):
    found = minmax_partition(costs, stages, memory, caps)
    expected = brute_force(costs, stages, memory, caps)
    if expected is None:
        assert found is None
        return
    assert found is not None
    assert len(found) == stages and min(found) >= 1 and sum(found) == len(costs)
    assert bottleneck(costs, found) == pytest.approx(expected, abs=1e-9)
    if memory is not None:
        bounds = np.cumsum([0, *found])
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            assert sum(memory[a:b]) <= caps[k]


@settings(max_examples=400, deadline=None)
@given(instances(with_memory=False))
def test_matches_brute_force(case):
    check(*case)


@settings(max_examples=600, deadline=None)
@given(instances(with_memory=True))
def test_matches_brute_force_under_stage_capacities(case):
    check(*case)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0, 1e3, allow_nan=False), min_size=1, max_size=8),
    st.integers(1, 8),
)
def test_real_valued_costs(costs, stages):
    stages = min(stages, len(costs))
    found = minmax_partition(costs, stages)
    assert bottleneck(costs, found) == pytest.approx(brute_force(costs, stages), rel=1e-9)


def test_torchgpipe_counterexample_is_solved_exactly():
    # blockpartition gives 35 here; the optimum is 30.
    assert bottleneck([5] * 7 + [20], minmax_partition([5] * 7 + [20], 2)) == 30


def test_memory_forces_a_worse_bottleneck():
    costs = [1, 1, 1, 1]
    assert minmax_partition(costs, 2) == [2, 2]
    # The first stage can hold only one layer's memory.
    assert minmax_partition(costs, 2, memory=[5, 5, 1, 1], caps=[5, 100]) == [1, 3]


def test_layer_that_fits_only_one_stage():
    # Layer 2 fits only stage 1's capacity: the greedy probe alone would miss it.
    found = minmax_partition([1, 1, 1, 1, 1], 3, memory=[0, 0, 9, 0, 0], caps=[1, 9, 1])
    assert found is not None
    bounds = np.cumsum([0, *found])
    assert bounds[1] <= 2 < bounds[2]


def test_infeasible_returns_none():
    assert minmax_partition([1, 1], 2, memory=[3, 3], caps=[2, 2]) is None


def test_large_instance_is_balanced():
    rng = np.random.default_rng(0)
    costs = rng.lognormal(size=100_000)
    found = minmax_partition(costs, 64)
    assert sum(found) == len(costs) and len(found) == 64
    # The optimum is within one layer's cost of the perfect average.
    assert bottleneck(costs, found) <= costs.sum() / 64 + costs.max()
