"""The exact split solvers (autopipe.planning.split.exact) against every split that fits."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe import PlanningError
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.split.exact import (
    gpipe_step_time,
    memory_split,
    optimal_split,
    solve_split,
    split_value,
)
from tests.support.planning_cases import linear_profile
from tests.support.planning_references import fitting_splits, random_model

# Memory shares, links and modes that exercise each pass: free transfers (the min-max
# pass and the even split), paid ones (the bound over the bottleneck), and data
# parallelism (the bound over the stages' parameters).
CASES = [
    {"capacity_share": None},
    {"capacity_share": 0.45},
    {"capacity_share": 0.45, "checkpoint": "auto"},
    {"capacity_share": 0.6, "bandwidth": 40.0},
    {"speeds": [1.0, 2.0, 0.5], "checkpoint": "except_last", "schedule": "gpipe"},
    {"data_parallel": 2, "allreduce_bandwidth": 200.0},
    {"capacity_share": 0.6, "data_parallel": 4, "allreduce_bandwidth": 50.0, "bandwidth": 80.0},
]


def _best(model: CostModel) -> float | None:
    values = [split_value(model, balance) for balance in fitting_splits(model)]
    return min(values, default=None)


def test_gpipe_step_time_is_the_sum_plus_the_bubble() -> None:
    assert gpipe_step_time([1.0, 3.0, 2.0], 4) == 6.0 + 3 * 3.0
    assert gpipe_step_time(np.array([5.0]), 1) == 5.0


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_solve_split_finds_the_least_step_time_of_every_fitting_split(case: dict) -> None:
    solved = 0
    for seed in range(8):
        model = random_model(seed, **case)
        expected = _best(model)
        found = solve_split(model)
        if expected is None:
            assert found is None
            continue
        assert found is not None
        value, balance = found
        assert value == pytest.approx(expected, rel=1e-9)
        assert balance in fitting_splits(model)
        assert split_value(model, balance) == pytest.approx(value, rel=1e-12)
        assert optimal_split(model) == balance
        solved += 1
    assert solved  # some models of each case fit


def test_split_value_is_the_gpipe_step_of_the_stage_times() -> None:
    costs = ProfileLines.from_profile(linear_profile([1.0, 2.0, 3.0, 4.0], chunks=4)).at(2)
    model = CostModel(costs, [DeviceSpec()] * 2, 4, "never", "gpipe", 2.0)
    # Forward 1 + 2 and 3 + 4 seconds, backward twice that: stages of 9 and 21 seconds.
    assert split_value(model, [2, 2]) == 30.0 + 3 * 21.0
    assert split_value(model, [1, 3]) == 30.0 + 3 * 27.0


def test_more_stages_than_layers_are_refused() -> None:
    model = random_model(0, layers=2, stages=3)
    assert solve_split(model) is None
    with pytest.raises(PlanningError, match="cannot split 2 layers into 3 non-empty stages"):
        optimal_split(model)


def test_nothing_fitting_names_the_layer_that_fits_nowhere() -> None:
    model = random_model(1, capacity_share=0.01)
    assert fitting_splits(model) == []
    assert solve_split(model) is None
    with pytest.raises(PlanningError, match=r"layer \d+ \(l\d+\) does not fit on any device"):
        optimal_split(model)
    with pytest.raises(PlanningError, match="does not fit on any device"):
        memory_split(model)


def test_nothing_fitting_names_the_stage_short_of_memory() -> None:
    # Layers of 400 bytes (with gradients and Adam states) fit 500 bytes alone, but two
    # stages of four layers hold two on one stage.
    costs = ProfileLines.from_profile(linear_profile([1.0] * 4, params=[100] * 4)).at(8)
    model = CostModel(costs, [DeviceSpec("cpu", 500)] * 2, 1, "never", "gpipe", 2.0)
    assert fitting_splits(model) == [] and solve_split(model) is None
    with pytest.raises(PlanningError, match=r"no split into 2 stages fits memory: even the best"):
        optimal_split(model)


def _peak(model: CostModel, balance: list[int]) -> float:
    bounds = np.cumsum([0, *balance])
    return max(
        float(model.stage_memory(k, np.array(bounds[k]), np.array(bounds[k + 1])))
        for k in range(len(balance))
    )


def test_memory_split_minimizes_the_largest_stage_memory() -> None:
    checked = 0
    for seed in range(8):
        model = random_model(seed, capacity_share=0.6)
        fitting = fitting_splits(model)
        if fitting:
            found = memory_split(model)
            assert found in fitting
            assert _peak(model, found) == min(_peak(model, balance) for balance in fitting)
            checked += 1
    assert checked


def test_one_stage_holds_every_layer() -> None:
    model = random_model(2, stages=1)
    assert solve_split(model) == (pytest.approx(split_value(model, [7])), [7])


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "auto"])
def test_band_is_the_most_layers_any_stage_holds(seed: int, checkpoint: str) -> None:
    # The band looks at each stage's signature once where it cannot widen: the same
    # width as every stage and every length tried.
    from autopipe.planning.split.exact import _band

    share = [0.2, 0.35, 0.5][seed % 3]
    model = random_model(seed, 9, 4, capacity_share=share, checkpoint=checkpoint, chunks=6)
    n = model.num_layers
    fitting = [
        d
        for d in range(1, n + 1)
        for k in range(model.num_stages)
        if np.any(model.stage_costs(k, np.arange(n - d + 1), np.arange(d, n + 1))[1]
                  <= model.capacity(k))
    ]  # fmt: skip
    assert _band(model) == max(fitting, default=1)
