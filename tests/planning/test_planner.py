"""``plan``: exact step-time minimization under memory, against brute force."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import DeviceSpec, PlanningError, plan
from autopipe.planning.model.layer_costs import calibrated_figures
from autopipe.planning.model.plan_settings import PlanSettings, build_model
from autopipe.planning.model.plans import PLAN_VERSION, Plan
from autopipe.planning.planner import evaluate
from tests.support.planning_cases import linear_profile, random_profile, splits
from tests.support.planning_references import check_against_brute_force
from tests.support.planning_strategies import device_specs


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
    check_against_brute_force(profile, devices, **kwargs)


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


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (None, "plan\\(\\) takes a Profile, got NoneType; measure one with"),
        ("model.json", "not the path 'model.json'; load it with Profile.load\\('model.json'\\)"),
        (Path("model.json"), "not the path 'model.json'"),
        ({"layers": []}, "not a dict; convert it with Profile.from_dict"),
    ],
)
def test_plan_takes_a_profile(profile, message):
    with pytest.raises(TypeError, match=message):
        plan(profile, 2)
    with pytest.raises(TypeError, match="evaluate\\(\\) takes a Profile"):
        evaluate(profile, [1, 1])


def test_rates_parse_like_the_command_line():
    profile = linear_profile([1.0] * 4, output=[1000] * 4)
    assert plan(profile, 2, bandwidth="1kB/s") == plan(profile, 2, bandwidth=1000.0)
    reduce = plan(profile, 2, data_parallel=2, allreduce_bandwidth="1GB")
    assert reduce == plan(profile, 2, data_parallel=2, allreduce_bandwidth=1e9)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"devices": 2.5}, TypeError, "devices must be a stage count or a list"),
        ({"bandwidth": "fast"}, ValueError, "cannot parse bandwidth 'fast'"),
        ({"bandwidth": "1e999"}, ValueError, "bandwidth '1e999' is not a finite rate"),
        ({"bandwidth": 0}, ValueError, "bandwidth must be positive"),
        ({"allreduce_bandwidth": float("nan")}, ValueError, "allreduce_bandwidth nan is not"),
        ({"memory": "1e999"}, ValueError, "memory '1e999' is not a finite size"),
        ({"memory": float("inf")}, ValueError, "memory inf is not a finite size"),
        ({"optimizer": float("nan")}, ValueError, "optimizer state factor must be a finite"),
        ({"optimizer": float("inf")}, ValueError, "optimizer state factor must be a finite"),
        ({"optimizer": None}, TypeError, "optimizer must be a name such as 'adam'"),
        ({"overhead": float("inf")}, ValueError, "overhead must be finite seconds >= 0"),
        ({"virtual_stages": 0}, ValueError, "virtual_stages must be a positive integer, got 0"),
        ({"padded": "no"}, TypeError, "padded must be True or False, got 'no'"),
    ],
)
def test_plan_refuses_bad_arguments(kwargs, error, message):
    profile = linear_profile([1.0] * 4)
    with pytest.raises(error, match=message):
        plan(profile, **{"devices": 2, **kwargs})


def test_evaluate_refuses_fractional_balances():
    with pytest.raises(ValueError, match="balance must be a list of layer counts per stage"):
        evaluate(linear_profile([1.0] * 4), [2.0, 2.0])


# ----------------------------------------------------------------------------------------
# Per-stage checkpointing (auto), data parallelism and calibration.


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 7),
    devices=st.lists(device_specs, min_size=1, max_size=4),
    chunks=st.integers(1, 6),
    checkpoint=st.sampled_from(["always", "except_last", "never", "auto"]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    data_parallel=st.integers(1, 3),
    allreduce=st.sampled_from([None, 100.0, 1000.0]),
    peaks=st.booleans(),
)
def test_auto_and_data_parallel_match_brute_force(
    seed, n, devices, chunks, checkpoint, schedule, data_parallel, allreduce, peaks
):
    devices = devices[:n]
    profile = random_profile(np.random.default_rng(seed), n, peaks=peaks)
    kwargs = {
        "chunks": chunks,
        "checkpoint": checkpoint,
        "schedule": schedule,
        "data_parallel": data_parallel,
        "batch": 16,
        "allreduce_bandwidth": allreduce,
    }
    check_against_brute_force(profile, devices, **kwargs)


def _per_stage_brute_force(profile, devices, **kwargs):
    """The best split and per-stage fixed modes, from models with one fixed mode each."""
    modes = ("never", "except_last", "always")
    models = {
        mode: build_model(profile, devices, PlanSettings(checkpoint=mode, **kwargs))
        for mode in modes
    }
    best = None
    for balance in splits(len(profile), len(devices)):
        bounds = np.cumsum([0, *balance])
        options = []
        for k in range(len(devices)):
            s, e = np.array(bounds[k]), np.array(bounds[k + 1])
            options.append(
                [
                    (float(models[m].stage_time(k, s, e)), m)
                    for m in modes
                    if models[m].stage_memory(k, s, e) <= models[m].capacity(k)
                ]
            )
        for choice in itertools.product(*options):
            times = [t for t, _ in choice]
            value = sum(times) + (models["never"].chunks - 1) * max(times)
            if best is None or value < best[0]:
                best = (value, [m for _, m in choice])
    return best


@pytest.mark.parametrize("seed", range(40))
def test_auto_is_the_best_choice_per_stage(seed):
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    devices = [DeviceSpec(memory=int(rng.integers(3_000, 30_000))) for _ in range(min(k, n))]
    profile = random_profile(rng, n, peaks=bool(seed % 2))
    kwargs = {"chunks": int(rng.integers(1, 6)), "schedule": ("gpipe", "1f1b")[seed % 3 == 0]}
    expected = _per_stage_brute_force(profile, devices, **kwargs)
    if expected is None:
        with pytest.raises(PlanningError):
            plan(profile, devices, checkpoint="auto", **kwargs)
        return
    found = plan(profile, devices, checkpoint="auto", **kwargs)
    # As fast as the best of the whole-stage modes, faster where units re-compute.
    if "units" in found.stage_checkpoints:
        assert found.step_time <= expected[0] * (1 + 1e-9)
    else:
        assert found.step_time == pytest.approx(expected[0], rel=1e-9)
    # Each stage runs the fastest mode that fits it.
    for stage in found.stages:
        faster = {
            "never": (),
            "except_last": ("never",),
            "always": ("never", "except_last"),
            "units": ("never",),
        }
        for mode in faster[stage.checkpoint]:
            alone = evaluate(profile, found.balance, devices, checkpoint=mode, **kwargs)
            assert alone.stages[stage.index].memory > (stage.capacity or 0)


def test_auto_checkpoints_only_where_needed():
    # 1F1B with M = 4 on 2 stages: stage 0 holds 2 micro-batches, stage 1 holds 1. Each
    # layer saves 1000 B per micro-batch; 2500 B fit 2 layers only if stage 0 checkpoints.
    profile = linear_profile([1.0] * 4, saved=[1000] * 4, batch=8, chunks=4)
    options = {"schedule": "1f1b", "optimizer": "sgd"}
    result = plan(profile, 2, checkpoint="auto", memory=2500, **options)
    assert result.balance == [2, 2]
    assert result.stage_checkpoints == ["except_last", "never"]
    assert result.stages[0].recompute > 0 and result.stages[1].recompute == 0
    never = evaluate(profile, [2, 2], checkpoint="never", **options)
    assert never.stages[0].memory > 2500 >= never.stages[1].memory
    every = plan(profile, 2, checkpoint="except_last", memory=2500, **options)
    assert result.step_time < every.step_time


def test_data_parallel_all_reduce():
    profile = linear_profile([1.0] * 4, params=[100, 200, 300, 400], batch=8, chunks=2)
    single = plan(profile, 2, checkpoint="never")
    double = plan(profile, 2, checkpoint="never", data_parallel=2, allreduce_bandwidth=10.0)
    assert double.data_parallel == 2 and double.micro_batch == 2  # 4 samples per replica
    # Ring all-reduce of the larger stage: 2·(D−1)/D · bytes / bandwidth.
    largest = max(
        sum(profile.layers[i].param_bytes for i in range(s.start, s.stop)) for s in double.stages
    )
    assert double.allreduce == pytest.approx(largest / 10.0)
    assert double.step_time == pytest.approx(double.pipeline_time + double.allreduce)
    assert double.throughput == pytest.approx(8 / double.step_time)
    assert double.pipeline_time < single.step_time
    free = plan(profile, 2, checkpoint="never", data_parallel=2)
    assert free.allreduce == 0.0
    with pytest.raises(ValueError, match="data_parallel must be between 1 and the batch"):
        plan(profile, 2, data_parallel=9)


def test_calibration_is_used():
    profile = linear_profile([1.0] * 4, output=[10] * 4, batch=8, chunks=2)
    plain = plan(profile, 2, checkpoint="never")
    profile.meta["calibration"] = {"overhead_s": 0.5, "bandwidth": 5.0}
    calibrated = plan(profile, 2, checkpoint="never")
    assert calibrated_figures(profile) == {"overhead_s": 0.5, "bandwidth": 5.0}
    assert all(d.bandwidth == 5.0 for d in calibrated.devices)
    assert calibrated.stages[0].overhead == 0.5
    # Overhead 0.5 per stage and micro-batch; stage 0 also sends 10 B at 5 B/s.
    assert calibrated.stages[0].time == pytest.approx(plain.stages[0].time + 0.5 + 2.0)
    explicit = plan(profile, 2, checkpoint="never", bandwidth=1e9, overhead=0.0)
    assert explicit.step_time == pytest.approx(plain.step_time, rel=1e-6)


def test_latency_and_compute_scale_calibrations():
    profile = linear_profile([1.0] * 4, output=[10] * 4, batch=8, chunks=2)
    plain = plan(profile, 2, checkpoint="never")
    profile.meta["calibration"] = {"latency_s": 0.25, "compute_scale": 1.5}
    calibrated = plan(profile, 2, checkpoint="never")
    assert calibrated_figures(profile) == {"latency_s": 0.25, "compute_scale": 1.5}
    # Every layer 1.5× longer; stage 0 pays one message latency per micro-batch, the last none.
    first, last = calibrated.stages
    assert first.compute == pytest.approx(1.5 * plain.stages[0].compute)
    assert first.transfer == pytest.approx(0.25)
    assert last.transfer == 0.0
    assert last.time == pytest.approx(1.5 * plain.stages[1].time)
    profile.meta["calibration"] = {"compute_scale": -1.0, "latency_s": float("nan")}
    assert plan(profile, 2, checkpoint="never").step_time == pytest.approx(plain.step_time)


def test_version_1_plans_still_load(tmp_path):
    result = plan(linear_profile([1.0] * 4), 2, checkpoint="always")
    data = result.to_dict()
    data["version"] = 1
    for key in ("data_parallel", "batch_size", "allreduce", "throughput", "notes"):
        del data[key]
    for stage in data["stages"]:
        for key in ("checkpoint", "recompute", "overhead", "allreduce"):
            del stage[key]
    loaded = Plan.from_dict(data)
    assert loaded.version == PLAN_VERSION and loaded.data_parallel == 1
    assert loaded.stage_checkpoints == ["always", "always"]
    assert loaded.balance == result.balance


def test_uneven_micro_batches_time_at_the_mean_size_and_memory_at_the_largest():
    from profiler.profile import LayerProfile, Profile

    # Forward 1 + 0.5·b seconds, backward free; saves 10·b bytes.
    layer = LayerProfile("l", "Linear", [2.0, 3.0], [0.0, 0.0], [20, 40], [20, 40])
    profile = Profile(layers=[layer], batch_sizes=[2, 4], input=[8, 16], batch_size=10, chunks=4)
    result = evaluate(profile, [1], chunks=4, checkpoint="never")
    # 10 samples in 4 micro-batches of 3, 3, 2, 2: exactly 4·1 + 0.5·10 seconds of work.
    assert result.micro_batch == 3 and result.chunks == 4
    assert result.step_time == pytest.approx(4 * 1.0 + 0.5 * 10)
    # GPipe keeps all four micro-batches' saved bytes, counted at the largest size.
    assert result.stages[0].activation_memory == pytest.approx(4 * 30)


def test_single_device_configurations_use_the_scales_of_one_rank_alone():
    from autopipe.planning import search

    profile = linear_profile([1.0] * 4, batch=8, chunks=2)
    plain = {k: plan(profile, k, checkpoint="never").step_time for k in (1, 2)}
    profile.meta["calibration"] = {"compute_scale": 2.0, "alone_compute_scale": 1.0}
    assert plan(profile, 1, checkpoint="never").step_time == pytest.approx(plain[1])
    assert plan(profile, 2, checkpoint="never").step_time == pytest.approx(2 * plain[2])
    found = {
        (p.num_stages, p.data_parallel, p.chunks): p.step_time
        for p in search(profile, 2, checkpoints=("never",), schedules=("gpipe",), top=50)
    }
    assert found[(1, 1, 2)] == pytest.approx(plain[1])
    assert found[(2, 1, 2)] == pytest.approx(2 * plain[2])


def test_padded_micro_batches_take_the_largest_size() -> None:
    # Times proportional to the batch: 14 rows in 4 micro-batches of 4, 4, 3, 3.
    profile = linear_profile([1.0, 2.0, 3.0, 1.0], batch=16, chunks=4)
    options = {"chunks": 4, "checkpoint": "never", "batch": 14}
    mean = evaluate(profile, [2, 2], **options)
    padded = evaluate(profile, [2, 2], padded=True, **options)
    full = evaluate(profile, [2, 2], **{**options, "batch": 16})
    assert padded.micro_batch == mean.micro_batch == 4
    assert [s.compute for s in padded.stages] == pytest.approx([s.compute for s in full.stages])
    assert padded.step_time > mean.step_time
    assert plan(profile, 2, padded=True, **options).step_time == pytest.approx(padded.step_time)


@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_parallel_plans_as_the_search_prices_that_mesh(tensor: int) -> None:
    # plan(tensor_parallel=t) is the mesh search's configuration t x K=2 x D=1, M=8:
    # the same split, stages, step and mesh, and not the unsharded t=1's.
    from autopipe.planning import Mesh, SearchOptions, search
    from tests.support.mesh_profiles import block_profile

    profile = block_profile(4, batch=8)
    fixed = {"memory": 60_000, "optimizer": "adam", "allreduce_bandwidth": 64.0}
    made = plan(profile, 2, tensor_parallel=tensor, chunks=8, checkpoint="never", **fixed)
    options = SearchOptions(
        schedules=("gpipe",), checkpoints=("never",), top=1000, tensor_parallel=(tensor,),
        micro_batch=1,
    )  # fmt: skip
    found = [
        p
        for p in search(profile, 2 * tensor, options=options, **fixed)
        if (p.num_stages, p.data_parallel) == (2, 1)
    ]
    assert len(found) == 1 and made.mesh == found[0].mesh == Mesh(tensor=tensor)
    assert made.balance == found[0].balance
    assert made.step_time == pytest.approx(found[0].step_time, rel=1e-12)
    for ours, theirs in zip(made.stages, found[0].stages, strict=True):
        assert ours.memory == pytest.approx(theirs.memory, rel=1e-12)
        assert ours.time == pytest.approx(theirs.time, rel=1e-12)
    whole = plan(profile, 2, chunks=8, checkpoint="never", **fixed)
    assert whole.mesh == Mesh() and made.step_time != whole.step_time
    assert max(s.memory for s in made.stages) < max(s.memory for s in whole.stages)


def test_tensor_parallel_needs_shard_counts_and_dividing_heads() -> None:
    from tests.support.mesh_profiles import block_profile

    with pytest.raises(ValueError, match="has no shard counts"):
        plan(linear_profile([1.0] * 4), 2, tensor_parallel=2)
    with pytest.raises(ValueError, match="tensor parallelism 3 does not divide"):
        plan(block_profile(4), 2, tensor_parallel=3)
    with pytest.raises(ValueError, match="tensor_parallel must be a positive integer"):
        plan(block_profile(4), 2, tensor_parallel=0)
    with pytest.raises(ValueError, match="priced by autopipe.plan"):
        build_model(block_profile(4), 2, PlanSettings(tensor_parallel=2))
