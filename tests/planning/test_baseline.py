"""A plan and its baseline priced on one cost model; the devices a profile is planned for."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest

from autopipe import plan
from autopipe.planning import baseline
from autopipe.planning.baseline import baseline_strategy, compare_plans, profile_devices
from autopipe.planning.model.names import STRATEGIES
from autopipe.planning.pipeline_settings import PipelineSettings
from autopipe.planning.planner import evaluate
from tests.support.planning_cases import linear_profile, random_profile


def test_baseline_strategy() -> None:
    assert baseline_strategy("optimal") == "uniform"
    assert baseline_strategy("parameters") == "uniform"
    assert baseline_strategy("uniform") == "optimal"


def test_profile_devices() -> None:
    cpu = linear_profile([1.0, 2.0])
    assert profile_devices(cpu, 2) == 2
    assert profile_devices(cpu, 2, 3) == 6
    assert profile_devices(cpu, 3, colocated=True) == ["cpu"] * 3
    cuda = copy.copy(cpu)
    cuda.device = "cuda:0"
    assert profile_devices(cuda, 2, 2) == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


@pytest.mark.parametrize("strategy", ["optimal", "uniform", "blockpartition"])
def test_the_same_plans_as_planning_twice(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = random_profile(np.random.default_rng(3), 10)
    settings = PipelineSettings(chunks=4, memory=9000, strategy=strategy).resolved(3, 8)
    built = []
    build = baseline.build_model
    monkeypatch.setattr(baseline, "build_model", lambda *a: built.append(1) or build(*a))
    compared = compare_plans(profile, 3, settings)
    assert len(built) == 1  # the baseline reuses the cost model
    other = baseline_strategy(strategy)
    assert compared.baseline_strategy == other
    assert compared.plan.to_dict() == plan(profile, 3, settings).to_dict()
    expected = plan(profile, 3, dataclasses.replace(settings, strategy=other))
    assert not isinstance(compared.baseline, str)
    assert compared.baseline.to_dict() == expected.to_dict()
    every = compared.every_strategy()
    assert len(built) == 1
    assert set(every) <= set(STRATEGIES) and {strategy, other} <= set(every)
    for name, found in every.items():
        again = plan(profile, 3, dataclasses.replace(settings, strategy=name))
        assert found.to_dict() == again.to_dict()


def test_a_baseline_that_does_not_fit_is_told() -> None:
    # Uniform puts the two large layers on one stage; the optimal split parts them.
    profile = linear_profile([1.0, 1.0, 1.0, 1.0], params=[1000, 1000, 10, 10], batch=4)
    apart = evaluate(profile, [1, 3], 2, chunks=1).stages
    together = evaluate(profile, [2, 2], 2, chunks=1).stages
    # Room for the parted split's stages, not for the stage holding both large layers.
    capacity = int(max(stage.memory for stage in apart)) + 1
    assert together[0].memory > capacity
    settings = PipelineSettings(chunks=1, memory=capacity).resolved(2, 4)
    compared = compare_plans(profile, 2, settings)
    assert compared.plan.strategy == "optimal"
    assert max(stage.memory for stage in compared.plan.stages) <= capacity
    assert isinstance(compared.baseline, str)
    assert compared.baseline.startswith("the uniform split [2, 2] does not fit")
