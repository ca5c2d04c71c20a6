"""The runner's figures: the plan and the search build one cost model from the same inputs."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest

from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.plan_settings import PlanSettings, build_model
from autopipe.planning.model.runner_figures import RunnerFigures
from tests.support.planning_cases import random_profile

CALIBRATED = {
    "overhead_s": 0.01,
    "virtual_overhead_s": 0.03,
    "bandwidth": 2e3,
    "latency_s": 0.002,
    "allreduce_bandwidth": 7e2,
}


def _same_model(planned: CostModel, searched: CostModel) -> None:
    for name in (
        "chunks",
        "checkpoint",
        "schedule",
        "optimizer",
        "overhead",
        "data_parallel",
        "allreduce_bandwidth",
        "virtual_stages",
    ):
        assert getattr(planned, name) == getattr(searched, name), name
    # The search names its devices cuda:0, cuda:1, ...; everything else is the same.
    assert [(d.memory, d.speed, d.bandwidth, d.latency) for d in planned.devices] == [
        (d.memory, d.speed, d.bandwidth, d.latency) for d in searched.devices
    ]
    for figure in fields(planned.layers):
        mine, theirs = getattr(planned.layers, figure.name), getattr(searched.layers, figure.name)
        if isinstance(mine, np.ndarray):
            np.testing.assert_array_equal(mine, theirs)
        else:
            assert mine == theirs, figure.name


@pytest.mark.parametrize("calibrated", [{}, CALIBRATED], ids=["uncalibrated", "calibrated"])
@pytest.mark.parametrize(
    ("stages", "replicas", "chunks", "virtual", "checkpoint", "schedule"),
    [
        (1, 1, 4, 1, "never", "gpipe"),
        (2, 1, 3, 1, "except_last", "1f1b"),
        (2, 2, 4, 1, "auto", "gpipe"),
        (2, 1, 4, 2, "never", "1f1b"),
        (3, 2, 2, 2, "never", "gpipe"),
    ],
)
@pytest.mark.parametrize(
    ("bandwidth", "allreduce"), [(None, None), ("5KB/s", None), (None, 400.0), (3e3, "1KB/s")]
)
def test_plan_and_search_build_the_same_model(
    calibrated, stages, replicas, chunks, virtual, checkpoint, schedule, bandwidth, allreduce
):
    profile = random_profile(np.random.default_rng(stages * 7 + chunks), 8)
    profile.meta["calibration"] = dict(calibrated)
    batch = 10
    settings = PlanSettings(
        chunks=chunks,
        memory=10**9,
        checkpoint=checkpoint,
        schedule=schedule,
        optimizer="sgd",
        bandwidth=bandwidth,
        data_parallel=replicas,
        batch=batch,
        allreduce_bandwidth=allreduce,
        virtual_stages=virtual,
    )
    planned = build_model(profile, stages * virtual, settings)
    space = Space(
        profile,
        capacity=10**9,
        bandwidth=bandwidth,
        allreduce_bandwidth=allreduce,
        optimizer="sgd",
    )
    replica = math.ceil(batch / replicas)
    micro = math.ceil(replica / chunks)
    config = Config(
        stages,
        replicas,
        math.ceil(replica / micro),
        micro,
        checkpoint,
        schedule,
        replica,
        virtual,
    )
    _same_model(planned, space.model(config))


def test_given_figures_win_over_calibrated_ones():
    profile = random_profile(np.random.default_rng(0), 4)
    profile.meta["calibration"] = dict(CALIBRATED)
    figures = RunnerFigures.resolve(profile, bandwidth="1KB/s", overhead=0.5)
    assert figures.bandwidth == 1e3
    assert figures.latency == CALIBRATED["latency_s"]
    assert figures.allreduce_bandwidth == CALIBRATED["allreduce_bandwidth"]
    assert figures.overhead_for(1, "gpipe") == figures.overhead_for(2, "zb") == 0.5


def test_virtual_stages_and_zero_bubble_take_the_virtual_overhead():
    profile = random_profile(np.random.default_rng(0), 4)
    profile.meta["calibration"] = {"overhead_s": 0.25, "bandwidth": 1e3}
    figures = RunnerFigures.resolve(profile)
    assert figures.allreduce_bandwidth == 1e3  # the link's, without a calibrated one
    assert figures.overhead_for(2, "gpipe") == 0.25  # not measured apart
    profile.meta["calibration"]["virtual_overhead_s"] = 1.5
    figures = RunnerFigures.resolve(profile)
    assert figures.overhead_for(1, "1f1b") == 0.25
    assert figures.overhead_for(1, "zb") == figures.overhead_for(2, "1f1b") == 1.5
