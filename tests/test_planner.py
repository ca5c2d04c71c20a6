"""``plan``: exact step-time minimization under memory, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import DeviceSpec, PlanningError, plan
from autopipe.planner import evaluate
from tests.planning_cases import linear_profile, random_profile, splits


def brute_force(profile, devices, **kwargs):
    best = None
    for balance in splits(len(profile), len(devices)):
        candidate = evaluate(profile, balance, devices, **kwargs)
        fits = all(s.capacity is None or s.memory <= s.capacity for s in candidate.stages)
        if fits and (best is None or candidate.step_time < best.step_time):
            best = candidate
    return best


device_specs = st.builds(
    DeviceSpec,
    memory=st.one_of(st.none(), st.integers(2_000, 40_000)),
    speed=st.sampled_from([0.5, 1.0, 2.0]),
    bandwidth=st.one_of(st.none(), st.sampled_from([50.0, 500.0])),
)


@settings(max_examples=250, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 7),
    devices=st.lists(device_specs, min_size=1, max_size=4),
    chunks=st.integers(1, 6),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    peaks=st.booleans(),
)
def test_optimal_matches_brute_force(seed, n, devices, chunks, checkpoint, schedule, peaks):
    devices = devices[:n]
    profile = random_profile(np.random.default_rng(seed), n, peaks=peaks)
    kwargs = {"chunks": chunks, "checkpoint": checkpoint, "schedule": schedule}
    expected = brute_force(profile, devices, **kwargs)
    if expected is None:
        with pytest.raises(PlanningError):
            plan(profile, devices, **kwargs)
        return
    found = plan(profile, devices, **kwargs)
    assert found.step_time == pytest.approx(expected.step_time, rel=1e-9)
    assert all(s.memory <= s.capacity for s in found.stages if s.capacity is not None)


def test_plan_fields_for_a_balanced_pipeline():
    profile = linear_profile([1.0] * 8, batch=16, chunks=4)
    result = plan(profile, 4, checkpoint="never")
    assert result.balance == [2, 2, 2, 2]
    assert [(s.start, s.stop) for s in result.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert result.stages[1].layers == ["l2", "l3"]
    assert result.bottleneck == pytest.approx(6.0)  # 2 × (forward 1 + backward 2)
    # Σ c + (M−1)·max c = 4·6 + 3·6.
    assert result.step_time == pytest.approx(42.0)
    # Balanced stages idle (K−1)/(M+K−1) of the step.
    assert result.bubble == pytest.approx(3 / 7)
    assert result.efficiency == pytest.approx(4 / 7)
    assert result.chunks == 4 and result.micro_batch == 4


def test_uneven_layers_beat_uniform():
    profile = linear_profile([1, 1, 1, 1, 1, 1, 6, 6], batch=8, chunks=2)
    best = plan(profile, 2, checkpoint="never")
    uniform = plan(profile, 2, checkpoint="never", strategy="uniform")
    assert best.balance == [6, 2] or best.balance == [7, 1]
    assert uniform.balance == [4, 4]
    assert best.step_time < uniform.step_time


def test_most_even_among_equal_bottlenecks():
    assert plan(linear_profile([1.0] * 10), 3, checkpoint="never").balance in (
        [4, 3, 3],
        [3, 4, 3],
        [3, 3, 4],
    )


def test_slow_device_gets_less_work():
    profile = linear_profile([1.0] * 9, chunks=4)
    result = plan(profile, [DeviceSpec(speed=2.0), DeviceSpec(speed=1.0)], checkpoint="never")
    assert result.balance == [6, 3]


def test_memory_limit_moves_layers():
    profile = linear_profile([1.0] * 4, params=[1000, 1000, 10, 10], chunks=1)
    free = plan(profile, 2, checkpoint="never", optimizer="sgd")
    assert free.balance == [2, 2]
    tight = plan(profile, 2, memory=2100, checkpoint="never", optimizer="sgd")
    assert tight.balance == [1, 3]
    assert all(s.memory <= 2100 for s in tight.stages)


def test_layer_that_never_fits_is_named():
    profile = linear_profile([1.0] * 3, params=[10, 10_000, 10])
    with pytest.raises(PlanningError, match=r"layer 1 \(l1\) does not fit .* needs"):
        plan(profile, 2, memory=1000)


def test_no_split_fits_names_the_stage_and_shortfall():
    profile = linear_profile([1.0] * 4, params=[100] * 4, chunks=1)
    with pytest.raises(PlanningError, match=r"needs 100 B more on stage \d"):
        plan(profile, 2, memory=300, optimizer="sgd", checkpoint="never")


def test_baseline_strategy_that_does_not_fit():
    profile = linear_profile([1.0] * 4, params=[1000, 1000, 10, 10])
    with pytest.raises(PlanningError, match="the uniform split .* does not fit: stage 0"):
        plan(profile, 2, memory=2100, optimizer="sgd", strategy="uniform")


def test_more_stages_than_layers():
    with pytest.raises(PlanningError, match="cannot split 2 layers into 3"):
        plan(linear_profile([1.0, 1.0]), 3)


def test_chunks_beyond_batch_size_shrink_to_single_samples():
    result = plan(linear_profile([1.0] * 4, batch=3, chunks=1), 2, chunks=8)
    assert result.chunks == 3 and result.micro_batch == 1


@pytest.mark.parametrize("strategy", ["optimal", "uniform", "parameters", "blockpartition"])
def test_strategies_produce_valid_plans(strategy):
    profile = random_profile(np.random.default_rng(3), 12)
    result = plan(profile, 3, strategy=strategy)
    assert result.strategy == strategy
    assert sum(result.balance) == 12 and len(result.stages) == 3


def test_optimal_never_worse_than_baselines():
    rng = np.random.default_rng(7)
    for _ in range(20):
        profile = random_profile(rng, 16)
        best = plan(profile, 4).step_time
        for strategy in ("uniform", "parameters", "blockpartition"):
            assert best <= plan(profile, 4, strategy=strategy).step_time * (1 + 1e-12)


def test_evaluate_checks_the_balance():
    profile = linear_profile([1.0] * 4)
    with pytest.raises(ValueError, match="must have entries >= 1 summing to 4"):
        evaluate(profile, [3, 2])
    with pytest.raises(ValueError, match="unknown strategy"):
        plan(profile, 2, strategy="best")
