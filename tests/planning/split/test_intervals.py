"""The interval solver on models of many identical layers: the cap search ends, exactly."""

from __future__ import annotations

import importlib
import re

import pytest

from autopipe.planning.configuration.config_search import search
from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.model.names import SEARCH_CHECKPOINTS
from autopipe.planning.split.exact import solve_split, split_value
from autopipe.planning.split.intervals import IntervalSolver
from autopipe.planning.split.screening import Relaxation
from profiler.profile import Profile
from tests.support.planning_cases import linear_profile
from tests.support.planning_references import exhaustive

intervals = importlib.import_module("autopipe.planning.split.intervals")


def identical_blocks(blocks: int, batch: int) -> Profile:
    """An embedding, ``blocks`` equal blocks, a norm and a head, with GB-sized parameters
    (a relative slack of 1e-9 on a cap is then more than a byte)."""
    forward = [2.0] + [5.0] * blocks + [0.5, 7.0]
    params = [3_000_000_000] + [2_000_000_000] * blocks + [10_000, 3_000_000_000]
    saved = [1_000_000_000] + [4_000_000_000] * blocks + [10_000_000, 2_000_000_000]
    output = [1_000_000] * len(forward)
    return linear_profile(
        forward, params=params, saved=saved, output=output, batch=batch, chunks=batch
    )


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_cap_search_below_a_plateau_is_exact(monkeypatch, stages):
    # One micro-batch and two replicas: the all-reduce of the largest stage dominates, so
    # the cap search must go below the first split's peak, where many caps tie.
    space = Space(
        identical_blocks(24, 8),
        capacity=None,
        bandwidth=1e6,
        allreduce_bandwidth=1e9,
        optimizer=0.0,
    )
    model = space.model(Config(stages, 2, 1, 8, "never", "1f1b"))
    solves = []
    search_caps = intervals.minimize_over_caps

    def counting(solve, *args, **kwargs):
        def counted(cap, limit):
            solves.append(cap)
            return solve(cap, limit)

        return search_caps(counted, *args, **kwargs)

    monkeypatch.setattr(intervals, "minimize_over_caps", counting)
    found = IntervalSolver(Relaxation(model)).solve()
    assert found is not None
    value, balance = found
    expected = solve_split(model)
    assert expected is not None
    # The bound is the value of its split (not a bound left by a spent budget) and optimal.
    assert split_value(model, balance) == pytest.approx(value, rel=1e-9)
    assert value == pytest.approx(expected[0], rel=1e-9)
    # Each solve lowers the cap below the last peak: few of the 27 layers' stage sums.
    assert len(solves) < 60
    assert len(set(solves)) == len(solves)


def test_search_on_identical_blocks_equals_exhaustive_plans():
    profile = identical_blocks(8, 4)
    options = {
        "memory": 80_000_000_000,
        "bandwidth": 1e9,
        "allreduce_bandwidth": 1e9,
        "optimizer": 2.0,
    }
    expected = exhaustive(
        profile,
        4,
        batch=4,
        checkpoints=SEARCH_CHECKPOINTS,
        schedules=("gpipe", "1f1b"),
        **options,
    )
    found = search(profile, 4, batch=4, top=5, **options)
    assert found[0].step_time == pytest.approx(expected[0][0], rel=1e-9)
    # The interval solver settles what it is given, but for ``auto`` stages that would
    # re-compute units (relaxed at no re-computation: a bound), left to the dynamic program.
    assert "0 solved by interval search" not in found[0].notes[0]
    assert re.search(r"\b[01] by dynamic programming", found[0].notes[0])
    values = [p.step_time for p in found]
    assert values == sorted(values)
    # Each is one configuration's exhaustive plan.
    for value in values:
        assert min(abs(value - v) for v, *_ in expected) <= 1e-9 * value
