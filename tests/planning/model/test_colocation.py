"""Stages that share a device take turns on it (autopipe.planning.model.colocation)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopipe.output.report import render_summary
from autopipe.planning.model.colocation import device_count, shared_groups, shared_step_time
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.planner import evaluate, plan
from tests.support.planning_cases import random_profile


def specs(*names: str) -> list[DeviceSpec]:
    return [DeviceSpec(name=name) for name in names]


def test_groups_only_in_one_process() -> None:
    devices = specs("cpu", "cpu", "cuda:0", "cpu")
    assert shared_groups(devices, colocated=True) == [[0, 1, 3]]
    # Ranks run their own processes on their own cores, whatever the names.
    assert shared_groups(devices, colocated=False) == []
    assert shared_groups(specs("cuda:0", "cuda:1"), colocated=True) == []
    assert device_count(4, [[0, 1, 3]]) == 2


def test_step_is_the_shared_devices_summed_work() -> None:
    times = [1.0, 2.0, 3.0]
    # All on one device: M · Σ c, not Σ c + (M−1)·max c.
    assert shared_step_time(times, 4, [[0, 1, 2]]) == 4 * 6.0
    # Nothing shared: GPipe's fill–drain.
    assert shared_step_time(times, 4, []) == 6.0 + 3 * 3.0
    # Stages 0 and 1 share a device: max(15, 4·3) — here the pipeline still binds.
    assert shared_step_time(times, 4, [[0, 1]]) == 15.0
    assert shared_step_time([3.0, 3.0, 1.0], 4, [[0, 1]]) == 4 * 6.0


@pytest.mark.parametrize("seed", range(4))
def test_plan_predicts_turns_on_one_device(seed: int) -> None:
    profile = random_profile(np.random.default_rng(seed), 7)
    one = plan(profile, ["cpu"] * 3, colocated=True, checkpoint="never")
    apart = plan(profile, ["cpu"] * 3, checkpoint="never")
    times = [stage.time for stage in one.stages]
    assert one.step_time == pytest.approx(one.chunks * sum(times))
    assert one.shared == [[0, 1, 2]] and apart.shared == []
    assert one.num_devices == 1 and one.bubble == pytest.approx(0.0)
    # The work is the same whatever the split: every split predicts the same step.
    other = evaluate(profile, [5, 1, 1], ["cpu"] * 3, colocated=True, checkpoint="never")
    assert other.step_time == pytest.approx(one.step_time)
    assert apart.step_time < one.step_time


@pytest.mark.parametrize("seed", range(4))
def test_one_device_split_needs_the_least_memory(seed: int) -> None:
    profile = random_profile(np.random.default_rng(seed), 6)
    chosen = plan(profile, ["cpu"] * 3, colocated=True, checkpoint="never")
    best = min(
        max(
            stage.memory
            for stage in evaluate(
                profile, list(b), ["cpu"] * 3, colocated=True, checkpoint="never"
            ).stages
        )
        for b in itertools.product(range(1, 5), repeat=3)
        if sum(b) == 6
    )
    assert max(stage.memory for stage in chosen.stages) == pytest.approx(best)


def test_report_says_the_stages_share_a_device() -> None:
    profile = random_profile(np.random.default_rng(0), 6)
    text = render_summary(plan(profile, ["cpu", "cpu"], colocated=True))
    assert "stages 0, 1 share cpu: they run one after another" in text
    assert "least memory per stage chose this one" in text
    assert "share" not in render_summary(plan(profile, ["cpu", "cpu"]))


def test_plan_round_trips_and_refuses_ranks_only_settings() -> None:
    from autopipe.planning.model.plans import Plan

    profile = random_profile(np.random.default_rng(1), 6)
    found = plan(profile, ["cpu", "cpu"], colocated=True)
    assert Plan.from_dict(found.to_dict()).shared == [[0, 1]]
    assert "shared" not in plan(profile, 2).to_dict()
    with pytest.raises(ValueError, match="single-process GPipe"):
        plan(profile, ["cpu", "cpu"], colocated=True, schedule="1f1b", virtual_stages=2, chunks=4)


@pytest.mark.parametrize("seed", range(3))
def test_a_plan_priced_again_for_stages_on_one_device(seed: int) -> None:
    from autopipe.planning.model.colocation import colocated_plan

    profile = random_profile(np.random.default_rng(seed), 7)
    for balance in ([3, 2, 2], [1, 1, 5]):
        apart = evaluate(profile, balance, ["cpu", "cpu", "cuda:0"], checkpoint="never")
        shared = evaluate(
            profile, balance, ["cpu", "cpu", "cuda:0"], colocated=True, checkpoint="never"
        )
        again = colocated_plan(apart, [[0, 1]])
        assert again.shared == shared.shared == [[0, 1]]
        assert again.stages == shared.stages and again.balance == balance
        # Integer-valued figures: the sums are exact in float64.
        assert again.step_time == shared.step_time
        assert again.bubble == pytest.approx(shared.bubble, abs=1e-12)
        assert again.throughput == pytest.approx(shared.throughput, rel=1e-12)
    assert colocated_plan(apart, []).step_time == apart.step_time
