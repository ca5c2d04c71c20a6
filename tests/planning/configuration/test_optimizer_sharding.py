"""Optimizer state sharded over the data-parallel replicas (ZeRO-1), and mixed precision."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import PlanningError, plan
from autopipe.output.report import render_plan, render_search
from autopipe.planning.configuration.config_search import search
from autopipe.planning.configuration.optimizer_sharding import settle
from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.model.cost_model import optimizer_factor
from autopipe.planning.model.names import SEARCH_CHECKPOINTS
from autopipe.planning.model.plans import PLAN_VERSION, Plan
from autopipe.planning.planner import evaluate
from profiler.profile import Profile, TiedState
from tests.support.planning_cases import linear_profile, random_profile, splits
from tests.support.planning_references import check_against_brute_force, exhaustive

PARAMS = [800, 400, 1200, 600]
SAVED = [64, 32, 96, 16]


def test_mixed_precision_names():
    assert optimizer_factor("adam-mixed") == optimizer_factor("AdamW-Mixed") == 6.0
    assert optimizer_factor("sgd-mixed") == 2.0 and optimizer_factor("momentum-mixed") == 4.0
    # The names before them keep their factors.
    old = {"none": 0.0, "sgd": 0.0, "momentum": 1.0, "adam": 2.0, "adamw": 2.0}
    assert {name: optimizer_factor(name) for name in old} == old
    assert optimizer_factor(1.5) == 1.5
    with pytest.raises(ValueError, match="adam-mixed"):
        optimizer_factor("lamb")


def test_adam_mixed_holds_16_bytes_per_two_byte_parameter():
    # 10 bf16 parameters of 2 bytes: weight 2 + gradient 2 + master 4 + m 4 + v 4 each.
    profile = linear_profile([1.0], params=[20])
    result = evaluate(profile, [1], optimizer="adam-mixed", checkpoint="never")
    assert result.stages[0].param_memory == 16 * 10
    assert result.optimizer == "adam-mixed"


def _by_hand(balance, replicas, shard, optimizer=2.0, batch=16, chunks=2):
    """Each stage's bytes, counted by hand: parameters and gradients whole, the optimizer
    state a 1/D share when sharded, and GPipe without checkpointing keeps every
    micro-batch's saved activations (M of them, each at the micro-batch size)."""
    micro = math.ceil(math.ceil(batch / replicas) / chunks)
    out, start = [], 0
    for size in balance:
        params = sum(PARAMS[start : start + size])
        state = optimizer * params / (replicas if shard else 1)
        saved = sum(SAVED[start : start + size]) * micro / 4  # SAVED is at 4 samples
        out.append((2 * params + state, 2 * params + state + chunks * saved))
        start += size
    return out


@pytest.mark.parametrize("replicas", [1, 2, 8])
@pytest.mark.parametrize("shard", [False, True])
def test_bytes_per_stage_are_exact(replicas, shard):
    profile = linear_profile([1.0] * 4, params=PARAMS, saved=SAVED, batch=16, chunks=4)
    for stages in (1, 2, 3):
        for balance in splits(4, stages):
            result = evaluate(
                profile,
                balance,
                data_parallel=replicas,
                shard_optimizer=shard,
                checkpoint="never",
                chunks=2,
                batch=16,
            )
            found = [value for s in result.stages for value in (s.param_memory, s.memory)]
            expected = [value for pair in _by_hand(balance, replicas, shard) for value in pair]
            assert found == pytest.approx(expected)
            assert result.shard_optimizer == (shard and replicas > 1)


def test_one_replica_changes_nothing():
    profile = random_profile(np.random.default_rng(0), 6)
    plain = plan(profile, 3, memory=20_000)
    sharded = plan(profile, 3, memory=20_000, shard_optimizer=True)
    assert sharded.to_dict() == plain.to_dict()


def test_tied_parameters_shard_each_copy():
    tied = TiedState(names=["head.weight", "embed.weight"], layers=[0, 3], bytes=200)
    base = linear_profile([1.0] * 4, params=PARAMS, batch=16)
    profile = Profile.from_dict({**base.to_dict(), "tied": [vars(tied)]})
    result = evaluate(profile, [4], data_parallel=4, shard_optimizer=True, checkpoint="never")
    # One copy of the tied tensor in the stage: 3000 − 200 parameter bytes.
    assert result.stages[0].param_memory == pytest.approx(2800 * (2 + 2 / 4))
    split = evaluate(profile, [2, 2], data_parallel=4, shard_optimizer=True, checkpoint="never")
    assert [s.param_memory for s in split.stages] == pytest.approx([1200 * 2.5, 1800 * 2.5])


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    stages=st.integers(1, 4),
    replicas=st.sampled_from([2, 4, 8]),
    memory=st.integers(1_500, 12_000),
    checkpoint=st.sampled_from(["except_last", "never", "auto"]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    optimizer=st.sampled_from(["adam", "adam-mixed"]),
)
def test_exact_split_with_sharding_equals_brute_force(
    seed, n, stages, replicas, memory, checkpoint, schedule, optimizer
):
    profile = random_profile(np.random.default_rng(seed), n)
    kwargs = {
        "memory": memory,
        "chunks": 2,
        "checkpoint": checkpoint,
        "schedule": schedule,
        "optimizer": optimizer,
        "data_parallel": replicas,
        "batch": 8,
        "allreduce_bandwidth": 500.0,
        "shard_optimizer": True,
    }
    check_against_brute_force(profile, [profile.device] * min(stages, n), **kwargs)


def test_plan_fits_only_with_sharding():
    profile = linear_profile([1.0] * 2, params=[1000, 1000], batch=8)
    # Unsharded each stage holds 4 × 1000 bytes; sharded over 2 replicas, 3 × 1000.
    with pytest.raises(PlanningError):
        plan(profile, 2, memory=3500, data_parallel=2, checkpoint="never")
    result = plan(
        profile, 2, memory=3500, data_parallel=2, checkpoint="never", shard_optimizer=True
    )
    assert [s.param_memory for s in result.stages] == [3000, 3000]
    assert "optimizer state sharded over 2 replicas" in render_plan(result)
    with pytest.raises(TypeError, match="shard_optimizer must be True or False"):
        plan(profile, 2, data_parallel=2, shard_optimizer="yes")


# One layer: no pipeline can split it, only sharding over replicas makes it fit.
def _one_layer() -> Profile:
    return linear_profile([1.0], params=[1000], batch=8)


def test_search_finds_what_only_sharding_fits():
    with pytest.raises(PlanningError, match="no configuration") as failed:
        search(_one_layer(), 2, memory=3500)
    assert "or shard the optimizer state over the replicas (--shard-optimizer" in str(failed.value)
    with pytest.raises(PlanningError) as failed:
        search(_one_layer(), 2, memory=2500, shard_optimizer=True)
    assert "shard the optimizer state" not in str(failed.value)
    for mode in (True, "auto"):
        plans = search(_one_layer(), 2, memory=3500, shard_optimizer=mode)
        best = plans[0]
        assert best.data_parallel == 2 and best.shard_optimizer
        assert best.stages[0].param_memory == 3000
        note = "optimizer state sharded over 2 replicas (ZeRO-1): unsharded it does not fit"
        assert note in best.notes
        assert note in render_search(plans)
        assert "optimizer state sharded over 2 replicas" in render_plan(best)


def test_auto_returns_plans_unsharded_where_they_fit_as_fast():
    profile = random_profile(np.random.default_rng(1), 5)
    options = {"batch": 8, "allreduce_bandwidth": 1e6, "top": 6}
    plain = search(profile, 4, **options)
    forced = search(profile, 4, shard_optimizer=True, **options)
    auto = search(profile, 4, shard_optimizer="auto", **options)
    # Unlimited memory: sharding changes no step time, and "auto" needs it nowhere.
    assert [p.step_time for p in auto] == pytest.approx([p.step_time for p in plain])
    assert [p.step_time for p in forced] == pytest.approx([p.step_time for p in plain])
    assert not any(p.shard_optimizer for p in auto)
    assert all(p.shard_optimizer == (p.data_parallel > 1) for p in forced)
    if auto[0].data_parallel > 1:
        assert any("ZeRO-1 not needed" in note for note in auto[0].notes)


def test_search_shards_only_where_it_needs_to():
    # One layer of 1000 parameter bytes, saving 100 bytes per sample: unsharded 4000 bytes
    # of state, sharded over 2 replicas 3000. With 4300 bytes only sharded replicas keep
    # GPipe's saved activations (400 bytes however the 4 samples are split) without
    # checkpointing; unsharded, only checkpointing (and its re-computation) fits.
    profile = linear_profile([1.0], params=[1000], saved=[800], batch=8)
    options = {"memory": 4300, "top": 20, "schedules": ("gpipe",)}
    plain = search(profile, 2, **options)
    auto = search(profile, 2, shard_optimizer="auto", **options)
    assert auto[0].step_time < plain[0].step_time
    assert plain[0].checkpoint != "never"
    best = auto[0]
    assert (best.data_parallel, best.checkpoint, best.shard_optimizer) == (2, "never", True)
    assert "optimizer state sharded over 2 replicas (ZeRO-1): unsharded it does not fit" in (
        best.notes
    )
    # A runner-up that fits as fast unsharded is returned unsharded, and says so.
    unsharded = [p for p in auto if p.data_parallel == 2 and not p.shard_optimizer]
    assert unsharded and all("ZeRO-1 not needed" in "; ".join(p.notes) for p in unsharded)
    assert all(p.stages[0].param_memory == 4000 for p in unsharded)


def test_a_configuration_slower_unsharded_stays_sharded():
    # Sharded over 2 replicas the even split [2, 2] fits (3 × 2000 bytes); unsharded only
    # [1, 3] does (4 × 1000), whose bottleneck is three layers.
    profile = linear_profile([1.0] * 4, params=[1000, 1000, 0, 0], batch=8, chunks=2)
    space = Space(
        profile,
        capacity=6500,
        bandwidth=None,
        allreduce_bandwidth=None,
        optimizer="adam",
        shard_optimizer=True,
    )
    config = Config(2, 2, 2, 2, "never", "gpipe", 4)
    model = space.model(config)
    for auto in (True, False):
        found = settle(space, config, model, [2, 2], auto)
        assert found.model is model and found.balance == [2, 2]
        assert found.note.startswith(
            "optimizer state sharded over 2 replicas (ZeRO-1): unsharded a step takes at least"
        )
    plain = Space(
        profile, capacity=None, bandwidth=None, allreduce_bandwidth=None, optimizer="adam"
    )
    assert not settle(plain, config, plain.model(config), [2, 2], True).note


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    devices=st.integers(1, 4),
    batch=st.integers(1, 6),
    memory=st.one_of(st.none(), st.integers(2_000, 12_000)),
    allreduce=st.sampled_from([None, 300.0, 3000.0]),
    optimizer=st.sampled_from(["adam", "adam-mixed"]),
)
def test_sharded_search_equals_exhaustive_plans(
    seed, n, devices, batch, memory, allreduce, optimizer
):
    profile = random_profile(np.random.default_rng(seed), n)
    options = {"memory": memory, "allreduce_bandwidth": allreduce, "optimizer": optimizer}
    expected = exhaustive(
        profile,
        devices,
        batch=batch,
        checkpoints=SEARCH_CHECKPOINTS,
        schedules=("gpipe", "1f1b"),
        shard_optimizer=True,
        **options,
    )
    for mode in (True, "auto"):
        if not expected:
            with pytest.raises(PlanningError, match="no configuration"):
                search(profile, devices, batch=batch, shard_optimizer=mode, **options)
            continue
        found = search(profile, devices, batch=batch, top=3, shard_optimizer=mode, **options)
        assert found[0].step_time == pytest.approx(expected[0][0], rel=1e-9)
        for result in found:
            assert all(s.capacity is None or s.memory <= s.capacity for s in result.stages)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    stages=st.integers(1, 3),
    replicas=st.sampled_from([2, 3]),
    chunks=st.integers(1, 3),
    memory=st.integers(1_000, 20_000),
    checkpoint=st.sampled_from(["always", "except_last", "never", "auto"]),
)
def test_screening_bound_stays_below_sharded_plans(
    seed, n, stages, replicas, chunks, memory, checkpoint
):
    stages = min(stages, n)
    profile = random_profile(np.random.default_rng(seed), n)
    space = Space(
        profile,
        capacity=memory,
        bandwidth=None,
        allreduce_bandwidth=400.0,
        optimizer="adam",
        shard_optimizer=True,
    )
    replica = math.ceil(8 / replicas)
    micro = math.ceil(replica / chunks)
    chunks = math.ceil(replica / micro)  # the micro-batches that size makes, as plan() counts
    config = Config(stages, replicas, chunks, micro, checkpoint, "gpipe", replica)
    bound, possible = space.bound(config)
    try:
        result = plan(
            profile,
            stages,
            memory=memory,
            chunks=chunks,
            checkpoint=checkpoint,
            data_parallel=replicas,
            batch=8,
            allreduce_bandwidth=400.0,
            shard_optimizer=True,
        )
    except PlanningError:
        return
    assert possible and bound <= result.step_time * (1 + 1e-9)


def test_interleaved_stages_shard_too():
    # Two ranks of two virtual stages each, 2 replicas: a rank holds 2000 parameter bytes,
    # 8000 with Adam unsharded, 2000 · (2 + 2/2) = 6000 sharded.
    profile = linear_profile([1.0] * 4, params=[1000] * 4, batch=8)
    options = {"memory": 7000, "checkpoint": "never", "batch": 8, "data_parallel": 2}
    with pytest.raises(PlanningError):
        plan(profile, 4, virtual_stages=2, **options)
    alone = plan(profile, 4, virtual_stages=2, shard_optimizer=True, **options)
    assert alone.shard_optimizer and [s.param_memory for s in alone.stages] == [3000] * 4
    found = search(
        profile,
        4,
        memory=7000,
        batch=8,
        checkpoints=("never",),
        virtual_stages=(1, 2),
        shard_optimizer="auto",
        top=100,
    )
    interleaved = [p for p in found if p.virtual_stages == 2 and p.data_parallel == 2]
    assert interleaved[0] is found[0]  # interleaving wins here
    assert all(p.shard_optimizer for p in interleaved)
    assert "optimizer state sharded over 2 replicas (ZeRO-1): unsharded it does not fit" in (
        found[0].notes
    )
    again = plan(
        profile,
        4,
        virtual_stages=2,
        shard_optimizer=True,
        chunks=interleaved[0].chunks,
        schedule=interleaved[0].schedule,
        **options,
    )
    assert interleaved[0].step_time == pytest.approx(again.step_time, rel=1e-9)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_search_refuses_other_values(value):
    with pytest.raises(ValueError, match="shard_optimizer must be True, False or 'auto'"):
        search(_one_layer(), 2, shard_optimizer=value)


def test_json_round_trip(tmp_path):
    result = plan(_one_layer(), 1, memory=3500, data_parallel=2, shard_optimizer=True)
    path = tmp_path / "plan.json"
    result.save(path)
    data = json.loads(path.read_text())
    assert data["shard_optimizer"] is True and data["version"] == PLAN_VERSION >= 3
    loaded = Plan.load(path)
    assert loaded.shard_optimizer and loaded.to_dict() == result.to_dict()


def test_older_plans_without_the_field_still_load(tmp_path):
    data = plan(_one_layer(), 1, data_parallel=2).to_dict()
    del data["shard_optimizer"]
    data["version"] = 2
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"kind": "plan", **data}))
    loaded = Plan.load(path)
    assert loaded.shard_optimizer is False and loaded.version == PLAN_VERSION
    data["shard_optimizer"] = "yes"
    with pytest.raises(ValueError, match="shard_optimizer"):
        Plan.from_dict({**data, "version": 3})
