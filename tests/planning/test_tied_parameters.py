"""Tied parameters in the plan: a copy on every stage that uses one, its gradients summed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import DeviceSpec, PlanningError, plan
from autopipe.output.report import render_plan
from autopipe.planning.configuration.config_search import search
from autopipe.planning.model.plans import Plan, TiedPlan
from autopipe.planning.planner import evaluate
from profiler.profile import Profile, TiedState
from tests.support.planning_cases import linear_profile, random_profile, splits
from tests.support.planning_references import exhaustive
from tests.support.planning_strategies import device_specs

# Layer parameters 100, 80, 50, 100 bytes; A (60 bytes) is used by layers 0 and 3, B (40
# bytes) by layers 0, 1 and 3: each user counts it in its param_bytes.
A = TiedState(names=["head.weight", "embed.weight"], layers=[0, 3], bytes=60)
B = TiedState(names=["norm.weight"], layers=[0, 1, 3], bytes=40)


def _tied_profile(*tied: TiedState) -> Profile:
    profile = linear_profile([1.0, 1.0, 1.0, 1.0], params=[100, 80, 50, 100])
    return Profile.from_dict({**profile.to_dict(), "tied": [vars(t) for t in tied]})


@pytest.mark.parametrize(
    ("balance", "params"),
    [
        ([4], [330 - 60 - 2 * 40]),  # one copy of A and of B
        ([2, 2], [180 - 40, 150]),  # B twice in stage 0; A once on each stage
        ([1, 2, 1], [100, 130, 100]),  # every stage one copy at most
        ([3, 1], [230 - 40, 100]),
    ],
)
def test_each_stage_counts_one_copy_of_what_it_uses(balance, params):
    profile = _tied_profile(A, B)
    for optimizer, factor in (("adam", 4), ("sgd", 2)):
        result = evaluate(profile, balance, optimizer=optimizer, checkpoint="never")
        assert [s.param_memory for s in result.stages] == [factor * p for p in params]
        assert [s.memory for s in result.stages] == [factor * p for p in params]


def test_stages_and_bytes_of_each_copy():
    result = evaluate(_tied_profile(A, B), [2, 2])
    assert result.tied == [
        TiedPlan(names=["head.weight", "embed.weight"], stages=[0, 1], bytes=60),
        TiedPlan(names=["norm.weight"], stages=[0, 1], bytes=40),
    ]
    assert [s.tied for s in result.stages] == [100, 100]
    alone = evaluate(_tied_profile(A), [3, 1]).stages
    assert [s.tied for s in alone] == [60, 60]
    assert evaluate(_tied_profile(A), [4]).tied[0].stages == [0]


def test_a_tied_buffer_is_held_once_per_stage_without_gradient_or_state():
    profile = linear_profile([1.0, 1.0, 1.0], params=[0, 0, 0])
    data = profile.to_dict()
    for layer in data["layers"]:
        layer["buffer_bytes"] = 24
    data["tied"] = [{"names": ["mask"], "layers": [0, 1, 2], "bytes": 24, "buffer": True}]
    profile = Profile.from_dict(data)
    devices = [DeviceSpec("cpu", bandwidth=1.0, latency=1.0)] * 2
    result = evaluate(profile, [2, 1], devices, checkpoint="never")
    assert [s.param_memory for s in result.stages] == [24, 24]
    assert result.tied_time == 0  # a buffer has no gradient to sum


def test_gradient_sum_time_is_a_ring_all_reduce_between_the_holders():
    devices = [
        DeviceSpec("a", bandwidth=100.0, latency=0.5),
        DeviceSpec("b", bandwidth=200.0, latency=0.25),
        DeviceSpec("c", bandwidth=400.0, latency=0.0),
    ]
    profile = _tied_profile(A, B)
    result = evaluate(profile, [1, 2, 1], devices)
    # A on stages 0 and 2: 2·1/2·60 bytes at the slowest holder's 100 B/s, 2·1 latencies.
    # B on all three: 2·2/3·40 bytes at 100 B/s and 2·2 latencies of 0.5 s.
    expected = [0.6 + 1.0, 2 * 2 / 3 * 40 / 100 + 2.0]
    assert [t.time for t in result.tied] == pytest.approx(expected)
    assert result.tied_time == pytest.approx(sum(expected))
    times = [s.time for s in result.stages]
    pipeline = sum(times) + (result.chunks - 1) * max(times)
    assert result.step_time == pytest.approx(pipeline + sum(expected))
    assert result.pipeline_time == pytest.approx(pipeline)
    # One stage holding every user sums nothing.
    assert evaluate(profile, [4], devices[:1]).tied_time == 0


def test_without_link_figures_the_sum_takes_the_all_reduce_bandwidth():
    profile = _tied_profile(A)
    result = evaluate(profile, [2, 2], 2, allreduce_bandwidth=30.0)
    assert result.tied_time == pytest.approx(60 / 30.0)
    assert evaluate(profile, [2, 2], 2).tied_time == 0  # free links: nothing known


def test_report_marks_tied_parameters():
    devices = [DeviceSpec("cpu", bandwidth=1e5)] * 2
    out = render_plan(evaluate(_tied_profile(A, B), [2, 2], devices))
    assert (
        "tied        head.weight = embed.weight on stages 0, 1 (60 B each; gradients "
        "summed, 600 µs a step)"
    ) in out
    assert "tied        norm.weight on stages 0, 1 (40 B each; gradients summed, 400 µs" in out
    assert "norm.weight on stage 0 (one copy, 40 B)" in render_plan(evaluate(_tied_profile(B), [4]))
    untied = linear_profile([1.0, 1.0, 1.0, 1.0], params=[100, 80, 50, 100])
    assert "tied" not in render_plan(evaluate(untied, [2, 2]))


def test_json_round_trip(tmp_path):
    devices = [DeviceSpec("cpu", bandwidth=100.0)] * 2
    result = plan(_tied_profile(A, B), devices, chunks=1)
    result.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.tied == result.tied and loaded.tied_time == result.tied_time > 0
    assert [s.tied for s in loaded.stages] == [s.tied for s in result.stages]
    assert Profile.from_dict(loaded.profile).tied == [A, B]


def test_untied_profiles_and_plans_write_what_they_wrote_before(tmp_path):
    profile = linear_profile([1.0, 2.0], params=[8, 8])
    assert "tied" not in profile.to_dict()
    data = evaluate(profile, [1, 1]).to_dict()
    assert "tied" not in data and "tied_time" not in data
    assert all("tied" not in stage for stage in data["stages"])
    # A profile saved before tied state was recorded loads with none.
    path = tmp_path / "old.json"
    profile.save(path)
    assert "tied" not in json.loads(path.read_text())
    assert Profile.load(path).tied == []


@pytest.mark.parametrize(
    ("tied", "message"),
    [
        ({"names": [], "layers": [0, 1], "bytes": 4}, "names must be a non-empty list"),
        ({"names": ["w"], "layers": [0], "bytes": 4}, "two or more ascending"),
        ({"names": ["w"], "layers": [1, 0], "bytes": 4}, "two or more ascending"),
        ({"names": ["w"], "layers": [0, 5], "bytes": 4}, "below 2"),
        ({"names": ["w"], "layers": [0, 1], "bytes": -1}, r"tied\[0\].bytes is -1"),
        ({"names": ["w"], "layers": [0, 1]}, "lacks field 'bytes'"),
        ({"names": ["w"], "layers": [0, 1], "bytes": 4, "size": 1}, "unknown field 'size'"),
    ],
)
def test_bad_tied_entries_are_refused(tied, message):
    data = {**linear_profile([1.0, 1.0], params=[8, 8]).to_dict(), "tied": [tied]}
    with pytest.raises(ValueError, match=message):
        Profile.from_dict(data)


def _random_tied(rng: np.random.Generator, profile: Profile) -> Profile:
    """``profile`` with one to three tensors tied between random layers, each user
    counting them in its parameters."""
    n = len(profile)
    data = profile.to_dict()
    tied = []
    for _ in range(int(rng.integers(1, 4))):
        users = sorted(rng.choice(n, size=int(rng.integers(2, n + 1)), replace=False).tolist())
        size = int(rng.integers(1, 400))
        for k in users:
            data["layers"][k]["param_bytes"] += size
        tied.append({"names": [f"w{len(tied)}"], "layers": users, "bytes": size})
    data["tied"] = tied
    return Profile.from_dict(data)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 7),
    devices=st.lists(device_specs, min_size=1, max_size=4),
    chunks=st.integers(1, 6),
    checkpoint=st.sampled_from(["always", "except_last", "never", "auto"]),
    schedule=st.sampled_from(["gpipe", "1f1b"]),
    data_parallel=st.integers(1, 3),
    allreduce=st.sampled_from([None, 1000.0]),
)
def test_optimal_with_tied_parameters_matches_brute_force(
    seed, n, devices, chunks, checkpoint, schedule, data_parallel, allreduce
):
    """Exact in memory (what fits), and in the step time less the tied gradient sums."""
    rng = np.random.default_rng(seed)
    profile = _random_tied(rng, random_profile(rng, n))
    devices = devices[:n]
    kwargs = {
        "chunks": chunks,
        "checkpoint": checkpoint,
        "schedule": schedule,
        "data_parallel": data_parallel,
        "batch": 16,
        "allreduce_bandwidth": allreduce,
    }
    best = None
    for balance in splits(n, len(devices)):
        candidate = evaluate(profile, balance, devices, **kwargs)
        fits = all(s.capacity is None or s.memory <= s.capacity for s in candidate.stages)
        value = candidate.step_time - candidate.tied_time
        if fits and (best is None or value < best):
            best = value
    if best is None:
        with pytest.raises(PlanningError):
            plan(profile, devices, **kwargs)
        return
    found = plan(profile, devices, **kwargs)
    assert found.step_time - found.tied_time == pytest.approx(best, rel=1e-9)
    assert all(s.memory <= s.capacity for s in found.stages if s.capacity is not None)
    again = evaluate(profile, found.balance, devices, **kwargs)
    assert found.step_time == pytest.approx(again.step_time, rel=1e-12)


def test_virtual_stages_of_one_rank_sum_nothing_between_them():
    devices = [DeviceSpec("cpu", bandwidth=100.0)] * 4
    on_rank_0 = TiedState(names=["w"], layers=[0, 2], bytes=60)
    apart = evaluate(_tied_profile(A), [1, 1, 1, 1], devices, virtual_stages=2)
    together = evaluate(_tied_profile(on_rank_0), [1, 1, 1, 1], devices, virtual_stages=2)
    # Stages 0 and 3 run on ranks 0 and 1 (of two); stages 0 and 2 both on rank 0.
    assert apart.tied[0].stages == [0, 3] and apart.tied_time == pytest.approx(60 / 100)
    assert together.tied[0].stages == [0, 2] and together.tied_time == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 5),
    devices=st.integers(1, 4),
    batch=st.integers(1, 6),
    memory=st.one_of(st.none(), st.integers(3_000, 30_000)),
)
def test_search_with_tied_parameters_equals_exhaustive_plans(seed, n, devices, batch, memory):
    """The search's bounds count a tied tensor from below: no configuration that fits is
    dropped (free links: the gradient sums take no time, every plan is exact)."""
    rng = np.random.default_rng(seed)
    profile = _random_tied(rng, random_profile(rng, n))
    options = {"memory": memory}
    checkpoints, schedules = ("never", "except_last", "auto"), ("gpipe", "1f1b")
    expected = exhaustive(
        profile, devices, batch=batch, checkpoints=checkpoints, schedules=schedules, **options
    )
    kwargs = {"batch": batch, "checkpoints": checkpoints, "schedules": schedules, **options}
    if not expected:
        with pytest.raises(PlanningError, match="no configuration"):
            search(profile, devices, **kwargs)
        return
    found = search(profile, devices, top=3, **kwargs)
    assert found[0].step_time == pytest.approx(expected[0][0], rel=1e-9)


def test_search_finds_a_single_device_that_holds_a_tied_tensor_once():
    # Counted twice, the tied 400 bytes would not fit 4·(100 + 500) = 2400 bytes.
    profile = linear_profile([1.0, 1.0], params=[500, 500])
    profile = Profile.from_dict(
        {**profile.to_dict(), "tied": [{"names": ["w"], "layers": [0, 1], "bytes": 400}]}
    )
    found = search(profile, 1, memory=2400, checkpoints=("never",), schedules=("gpipe",))
    assert found[0].stages[0].param_memory == 2400


def test_search_breakdown_names_the_tied_gradient_sums():
    from autopipe.planning.configuration.search_notes import breakdown

    devices = [DeviceSpec("cpu", bandwidth=100.0)] * 2
    result = evaluate(_tied_profile(A, B), [2, 2], devices)
    parts = breakdown(result)
    assert parts["tied"] == result.tied_time > 0
    assert sum(parts.values()) == pytest.approx(result.step_time, rel=1e-12)
    untied = linear_profile([1.0, 1.0, 1.0, 1.0], params=[100, 80, 50, 100])
    assert "tied" not in breakdown(evaluate(untied, [2, 2], devices))


def test_search_report_marks_the_best_plans_tied_parameters():
    from autopipe.output.report import render_search

    found = search(_tied_profile(A), 2, checkpoints=("never",), schedules=("gpipe",), top=2)
    out = render_search(found)
    stages = ", ".join(str(k) for k in found[0].tied[0].stages)
    word = "stages" if len(found[0].tied[0].stages) > 1 else "stage"
    assert f"\n- tied head.weight = embed.weight on {word} {stages} (" in out
    untied = linear_profile([1.0, 1.0, 1.0, 1.0], params=[100, 80, 50, 100])
    assert "tied" not in render_search(search(untied, 2, checkpoints=("never",), top=2))
