"""The relaxed min-max partition (autopipe.planning.split.screening): a lower bound on the best
split's step time, the optimum itself without transfers, and the memory shortfall."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.split.exact import split_value
from autopipe.planning.split.screening import Relaxation
from tests.support.planning_references import fitting_splits, random_model

# Models the relaxation is exact on: equal speeds, free transfers, one checkpoint mode.
EXACT = [
    {"capacity_share": None},
    {"capacity_share": 0.45},
    {"capacity_share": 0.45, "checkpoint": "always"},
    {"capacity_share": 0.6, "data_parallel": 2, "allreduce_bandwidth": 100.0},
]
# Models it only bounds: paid transfers, unequal speeds, modes chosen per stage.
BOUNDED = [
    {"capacity_share": 0.6, "bandwidth": 40.0},
    {"speeds": [1.0, 2.0, 0.5], "checkpoint": "except_last"},
    {"capacity_share": 0.45, "checkpoint": "auto"},
    {"capacity_share": 0.6, "data_parallel": 4, "allreduce_bandwidth": 50.0, "bandwidth": 80.0},
]


def _best(model) -> float | None:
    return min((split_value(model, b) for b in fitting_splits(model)), default=None)


@pytest.mark.parametrize("case", EXACT + BOUNDED, ids=range(len(EXACT + BOUNDED)))
def test_lower_bound_never_exceeds_the_best_split(case: dict) -> None:
    for seed in range(8):
        model = random_model(seed, **case)
        best, found = _best(model), Relaxation(model).lower_bound()
        if best is None:
            continue  # what the relaxation says of such models is checked below
        assert found is not None
        assert found[0] <= best * (1 + 1e-9)


@pytest.mark.parametrize("case", EXACT, ids=range(len(EXACT)))
def test_lower_bound_is_the_optimum_without_transfers(case: dict) -> None:
    solved = 0
    for seed in range(8):
        model = random_model(seed, **case)
        best, found = _best(model), Relaxation(model).lower_bound()
        if best is None:
            continue
        assert found is not None
        bound, balance = found
        assert bound == pytest.approx(best, rel=1e-9)
        assert balance in fitting_splits(model)  # memory is exact: its split fits
        assert split_value(model, balance) == pytest.approx(best, rel=1e-9)
        solved += 1
    assert solved


def test_nothing_fits_even_relaxed() -> None:
    model = random_model(1, capacity_share=0.01)
    assert fitting_splits(model) == []
    assert Relaxation(model).lower_bound() is None


def test_a_bound_past_stop_only_proves_that_nothing_beats_stop() -> None:
    model = random_model(0, capacity_share=0.45, data_parallel=2, allreduce_bandwidth=100.0)
    best = _best(model)
    assert best is not None
    found = Relaxation(model).lower_bound(stop=best / 2)
    assert found is not None and best / 2 <= found[0] <= best * (1 + 1e-9)


def test_shortfall_is_the_fewest_bytes_with_which_a_split_fits() -> None:
    checked = 0
    for seed in range(8):
        model = random_model(seed, capacity_share=0.2)
        relaxation = Relaxation(model)
        short = relaxation.shortfall(rtol=0.01)
        if fitting_splits(model):
            assert short == 0.0
            continue
        assert fitting_splits(model, extra=short) == []
        assert fitting_splits(model, extra=short / 0.99 + 1.0) != []
        # It leaves the relaxation as it found it.
        assert relaxation.extra == 0.0 and relaxation.lower_bound() is None
        checked += 1
    assert checked


def test_minmax_bounds_the_bottleneck_of_every_split() -> None:
    for seed in range(6):
        model = random_model(seed, capacity_share=0.6, bandwidth=40.0)
        relaxation = Relaxation(model)
        fitting = fitting_splits(model)
        found = relaxation.minmax()
        if not fitting:
            continue
        assert found is not None
        least = min(
            max(
                float(model.stage_time(k, np.array(s), np.array(e)))
                for k, (s, e) in enumerate(zip(np.cumsum([0, *b])[:-1], np.cumsum(b)))
            )
            for b in fitting
        )
        assert found[0] <= least * (1 + 1e-9)
