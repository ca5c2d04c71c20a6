"""The split of K·v interleaved stages (autopipe.planning.split.interleaved_balance): every split
at once when few, else a local search from given starts; against every split."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from autopipe.planning.planner import evaluate, plan
from autopipe.planning.split import interleaved_balance
from autopipe.planning.split.interleaved_balance import (
    every_split,
    interleaved_split,
    pipeline_time,
)
from tests.support.planning_cases import linear_profile, splits
from tests.support.planning_references import (
    check_replayed_split,
    fitting_rank_splits,
    random_model,
)

OPTIONS = {"stages": 4, "virtual_stages": 2, "schedule": "1f1b", "checkpoint": "never"}


def _moves_by_one(balance: list[int]) -> list[list[int]]:
    """Every split one cut point and one layer away."""
    found = []
    for cut in range(len(balance) - 1):
        for delta in (1, -1):
            moved = list(balance)
            moved[cut] += delta
            moved[cut + 1] -= delta
            if min(moved) >= 1:
                found.append(moved)
    return found


@pytest.mark.parametrize(("layers", "stages"), [(2, 2), (5, 5), (7, 3), (9, 4)])
def test_every_split_lists_the_bounds_of_each_split(layers: int, stages: int) -> None:
    rows = every_split(layers, stages)
    assert rows.shape == (math.comb(layers - 1, stages - 1), stages + 1)
    assert rows.tolist() == [np.cumsum([0, *b]).tolist() for b in splits(layers, stages)]


def test_every_split_into_one_stage_is_the_whole_model() -> None:
    assert every_split(5, 1).tolist() == [[0, 5]]


@pytest.mark.parametrize("share", [None, 0.5, 0.4])
def test_interleaved_split_is_the_fastest_split_that_fits(share: float | None) -> None:
    checked = 0
    for seed in range(6):
        model = random_model(seed, capacity_share=share, **OPTIONS)
        checked += check_replayed_split(model)
    assert checked


def test_local_search_ends_where_no_move_of_one_cut_helps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(interleaved_balance, "EXHAUSTIVE", 0)
    for seed in range(6):
        model = random_model(seed, layers=9, **OPTIONS)
        starts = [[6, 1, 1, 1], [1, 1, 1, 6]]
        found = interleaved_split(model, starts)
        assert found is not None and sum(found) == 9 and min(found) >= 1
        value = pipeline_time(model, found)
        assert all(value <= pipeline_time(model, s) for s in starts)
        # The search moves cuts by 1, 2, 4, ... layers: none of the moves by one helps.
        assert all(value <= pipeline_time(model, b) * (1 + 1e-12) for b in _moves_by_one(found))


def test_nothing_fits_in_either_search(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model(1, capacity_share=0.01, **OPTIONS)
    assert fitting_rank_splits(model) == []
    assert interleaved_split(model, [[2, 2, 2, 1]]) is None
    monkeypatch.setattr(interleaved_balance, "EXHAUSTIVE", 0)
    assert interleaved_split(model, [[2, 2, 2, 1]]) is None


def test_pipeline_time_ignores_memory() -> None:
    tight = random_model(1, capacity_share=0.01, **OPTIONS)
    loose = random_model(1, **OPTIONS)
    assert pipeline_time(tight, [2, 2, 2, 1]) == pipeline_time(loose, [2, 2, 2, 1])
    assert math.isfinite(pipeline_time(tight, [2, 2, 2, 1]))


def _random_profiles(count: int, seed: int) -> list[object]:
    rng = random.Random(seed)
    profiles = []
    for _ in range(count):
        forward = [rng.lognormvariate(0, 1) for _ in range(rng.randint(6, 10))]
        profiles.append(linear_profile(forward, batch=8, chunks=4))
    return profiles


def test_virtual_stage_split_is_the_best_of_all_splits() -> None:
    for profile in _random_profiles(15, seed=1):
        options = {"chunks": 4, "virtual_stages": 2, "schedule": "1f1b", "checkpoint": "never"}
        got = plan(profile, 4, **options).step_time
        best = min(evaluate(profile, b, **options).step_time for b in splits(len(profile), 4))
        assert got == pytest.approx(best)


def test_local_search_is_never_worse_than_its_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interleaved_balance, "EXHAUSTIVE", 0)  # as for large models
    options = {"chunks": 4, "virtual_stages": 2, "schedule": "1f1b", "checkpoint": "never"}
    for profile in _random_profiles(15, seed=2):
        got = plan(profile, 4, **options).step_time
        exact_flat = plan(profile, 4, chunks=4, schedule="1f1b", checkpoint="never").balance
        uniform = plan(profile, 4, strategy="uniform", **options).balance
        for start in (exact_flat, uniform):
            assert got <= evaluate(profile, start, **options).step_time * (1 + 1e-9)
