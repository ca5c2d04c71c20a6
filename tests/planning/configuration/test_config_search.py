"""``search`` (autopipe.planning.configuration.config_search): ranking of pipeline × data-parallel
configurations against exhaustive plans."""

from __future__ import annotations

import importlib
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import PlanningError, plan
from autopipe.output.report import render_search
from autopipe.planning.configuration.config_search import search
from autopipe.planning.configuration.search_notes import breakdown
from autopipe.planning.model.names import SEARCH_CHECKPOINTS
from tests.support.planning_cases import linear_profile, random_profile, uneven_profile
from tests.support.planning_references import exhaustive


def test_even_search_splits_the_batch_exactly():
    profile = random_profile(np.random.default_rng(3), 6)
    everything = search(profile, 4, batch=12, top=200)
    even = search(profile, 4, batch=12, top=200, even=True)
    assert even and all(12 % p.data_parallel == 0 for p in even)
    assert all((12 // p.data_parallel) % p.chunks == 0 for p in even)
    assert any(12 % p.data_parallel or (12 // p.data_parallel) % p.chunks for p in everything)
    assert len(even) < len(everything)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    devices=st.integers(1, 4),
    batch=st.integers(1, 6),
    memory=st.one_of(st.none(), st.integers(3_000, 30_000)),
    bandwidth=st.sampled_from([None, 200.0]),
    allreduce=st.sampled_from([None, 300.0, 3000.0]),
    peaks=st.booleans(),
)
def test_best_equals_exhaustive_plans(seed, n, devices, batch, memory, bandwidth, allreduce, peaks):
    profile = random_profile(np.random.default_rng(seed), n, peaks=peaks)
    options = {"memory": memory, "bandwidth": bandwidth, "allreduce_bandwidth": allreduce}
    expected = exhaustive(
        profile,
        devices,
        batch=batch,
        checkpoints=SEARCH_CHECKPOINTS,
        schedules=("gpipe", "1f1b"),
        **options,
    )
    if not expected:
        with pytest.raises(PlanningError, match="no configuration"):
            search(profile, devices, batch=batch, **options)
        return
    found = search(profile, devices, batch=batch, top=3, **options)
    assert found[0].step_time == pytest.approx(expected[0][0], rel=1e-9)
    values = [p.step_time for p in found]
    assert values == sorted(values)
    for result in found:  # each plan is what plan() predicts for its configuration
        again = plan(
            profile,
            result.num_stages,
            chunks=result.chunks,
            checkpoint=result.checkpoint,
            schedule=result.schedule,
            data_parallel=result.data_parallel,
            batch=batch,
            **options,
        )
        assert result.step_time == pytest.approx(again.step_time, rel=1e-9)
        assert result.throughput == pytest.approx(batch / result.step_time)
        assert all(s.capacity is None or s.memory <= s.capacity for s in result.stages)


@pytest.mark.parametrize("seed", range(6))
def test_top_list_equals_exhaustive_ranking(seed):
    # One mode and schedule, and batch sizes whose replicas all differ: no configuration is
    # left out as redundant, so the ranking must match exactly.
    profile = random_profile(np.random.default_rng(seed), 6)
    options = {"memory": 20_000, "bandwidth": 300.0, "allreduce_bandwidth": 1000.0}
    expected = exhaustive(
        profile, 4, batch=12, checkpoints=("never",), schedules=("gpipe",), **options
    )
    distinct = sorted({(value, k, d, m) for value, k, d, m, _, _ in expected})
    found = search(
        profile, 4, batch=12, checkpoints=("never",), schedules=("gpipe",), top=8, **options
    )
    assert [p.step_time for p in found] == pytest.approx([v for v, *_ in distinct[:8]], rel=1e-9)


def _interleaved_plans(profile, devices, batch, **options):
    """Every interleaved configuration's plan() that fits: (step time, K, v, D, M, schedule)."""
    found = []
    for k, v in itertools.product(range(2, devices + 1), range(2, 4)):
        if k * v > len(profile):
            continue
        for d in range(1, devices // k + 1):
            replica = math.ceil(batch / d)
            for m, schedule in itertools.product(range(1, replica + 1), ("gpipe", "1f1b")):
                if schedule == "1f1b" and m % (m // max(1, m // k)):
                    continue  # interleaved 1F1B takes M in whole rounds only
                try:
                    result = plan(
                        profile,
                        k * v,
                        chunks=m,
                        checkpoint="never",
                        schedule=schedule,
                        data_parallel=d,
                        batch=batch,
                        virtual_stages=v,
                        **options,
                    )
                except PlanningError:
                    continue
                found.append((result.step_time, k, v, d, result.chunks, schedule))
    return sorted(found)


@pytest.mark.parametrize("seed", range(4))
def test_virtual_stages_are_searched_like_plans(seed):
    profile = random_profile(np.random.default_rng(seed), 8)
    # A cheap runner for virtual stages and a slow all-reduce: interleaving wins.
    profile.meta["calibration"] = {"overhead_s": 2e-3, "virtual_overhead_s": 1e-4}
    options = {"memory": 60_000, "allreduce_bandwidth": 10.0}
    never = {"checkpoints": ("never",)}
    flat = exhaustive(profile, 4, batch=8, schedules=("gpipe", "1f1b"), **never, **options)
    interleaved = _interleaved_plans(profile, 4, 8, **options)
    best = min([row[0] for row in flat] + [row[0] for row in interleaved])
    found = search(profile, 4, batch=8, virtual_stages=(1, 2, 3), top=5, **never, **options)
    assert found[0].step_time == pytest.approx(best, rel=1e-9)
    assert found[0].virtual_stages > 1 and best < min(row[0] for row in flat)
    assert "interleaved by replayed schedules" in found[0].notes[0]
    for result in found:  # each plan is what plan() predicts for its configuration
        again = plan(
            profile,
            result.num_stages,
            chunks=result.chunks,
            checkpoint="never",
            schedule=result.schedule,
            data_parallel=result.data_parallel,
            batch=8,
            virtual_stages=result.virtual_stages,
            **options,
        )
        assert result.step_time == pytest.approx(again.step_time, rel=1e-9)
        parts = breakdown(result)
        assert sum(parts.values()) == pytest.approx(result.step_time, rel=1e-9)
        assert min(parts.values()) >= -1e-9 * result.step_time
    # Without a calibration of their own, virtual stages pay the single-stage overhead.
    del profile.meta["calibration"]["virtual_overhead_s"]
    slow = search(profile, 4, batch=8, virtual_stages=(1, 2), top=50, **never, **options)
    assert all(s.overhead == 2e-3 for p in slow for s in p.stages)


def test_virtual_stages_need_positive_counts():
    profile = random_profile(np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match="virtual_stages must be positive integers"):
        search(profile, 2, virtual_stages=(1, 0))


def test_memory_pushes_to_pipelines_and_checkpointing():
    layers = 16
    profile = linear_profile(
        [1.0] * layers, saved=[4000] * layers, params=[1000] * layers, batch=32, chunks=1
    )
    free = search(profile, 8, optimizer="sgd")
    assert free[0].num_stages == 1 and free[0].data_parallel == 8  # no bubble, free all-reduce
    # 32,000 B of parameters and gradients: one device cannot hold them all.
    tight = search(profile, 8, memory=20_000, optimizer="sgd")
    best = tight[0]
    assert best.num_stages > 1
    assert all(s.memory <= 20_000 for s in best.stages)
    assert any("K=1 D=8 M=1 never gpipe could be up to" in note for note in best.notes)
    assert free[0].step_time < best.step_time


def test_allreduce_cost_limits_data_parallelism():
    profile = linear_profile([1.0] * 8, params=[10_000] * 8, batch=16, chunks=1)
    free = search(profile, 4, optimizer="sgd")
    slow = search(profile, 4, optimizer="sgd", allreduce_bandwidth=100.0)
    assert free[0].data_parallel == 4
    assert slow[0].data_parallel < 4
    assert slow[0].allreduce < free[0].step_time
    parts = breakdown(slow[0])
    assert sum(parts.values()) == pytest.approx(slow[0].step_time)


def test_notes_explain_the_losers():
    profile = random_profile(np.random.default_rng(4), 12)
    found = search(profile, 4, memory=60_000, allreduce_bandwidth=2000.0, top=6)
    assert found[0].notes[0].startswith("best of ")
    for loser in found[1:]:
        assert len(loser.notes) == 1
        note = loser.notes[0]
        assert note.startswith("ties with the best") or "x the best step: " in note
    table = render_search(found)
    assert table.splitlines()[0].split()[:4] == ["#", "K", "D", "M"]
    assert "best" in table.splitlines()[1]


def test_auto_checkpointing_is_found_when_needed():
    # Only stage 0 (which keeps the most micro-batches under 1F1B) must checkpoint.
    profile = linear_profile([1.0] * 8, saved=[3000] * 8, batch=8, chunks=8)
    found = search(profile, 2, memory=30_000, checkpoints=("never", "except_last", "auto"), top=20)
    auto = [p for p in found if p.checkpoint == "auto"]
    assert auto and any("never" in p.stage_checkpoints for p in auto)
    assert all(p.stage_checkpoints != ["never"] * p.num_stages for p in auto)


def test_auto_mixes_modes_under_gpipe():
    # The first four layers save 30x more: only the stage holding them checkpoints.
    profile = linear_profile([1.0] * 8, saved=[3000] * 4 + [100] * 4, batch=8, chunks=8)
    found = search(profile, 2, memory=20_000, schedules=("gpipe",), top=5)
    mixed = [p for p in found if p.checkpoint == "auto" and p.num_stages == 2]
    assert [p.stage_checkpoints for p in mixed] == [["except_last", "never"]]
    # On one device per replica, re-computing some of the heavy units beats re-computing
    # the whole stage.
    assert found[0].stage_checkpoints == ["units"]
    assert set(found[0].stages[0].recompute_units) <= {0, 1, 2, 3}
    assert found[0].step_time < min(p.step_time for p in found if p.checkpoint != "auto")
    same = [p for p in found if (p.num_stages, p.chunks) == (2, 8)]
    assert same[0].checkpoint == "auto"  # faster than checkpointing both stages
    expected = exhaustive(
        profile,
        2,
        batch=8,
        checkpoints=SEARCH_CHECKPOINTS,
        schedules=("gpipe",),
        memory=20_000,
    )
    assert found[0].step_time == pytest.approx(expected[0][0])


def test_dynamic_program_fallback(monkeypatch):
    # Tier 3 only bounds when memory limits are not monotone; force that path everywhere.
    module = importlib.import_module("autopipe.planning.configuration.config_search")

    class Bounding:
        def __init__(self, relaxation, envelope=False):
            self.relaxation = relaxation

        def solve(self, stop):
            found = self.relaxation.lower_bound()
            return None if found is None else (0.0, found[1])

    profile = random_profile(np.random.default_rng(11), 7)
    options = {"memory": 12_000, "bandwidth": 300.0, "allreduce_bandwidth": 1000.0}
    expected = search(profile, 4, batch=8, top=4, **options)
    monkeypatch.setattr(module, "IntervalSolver", Bounding)
    found = search(profile, 4, batch=8, top=4, **options)
    assert "0 by dynamic programming" not in found[0].notes[0]
    assert [p.step_time for p in found] == pytest.approx([p.step_time for p in expected])


def test_nothing_fits():
    profile = linear_profile([1.0] * 4, params=[10_000] * 4)
    with pytest.raises(PlanningError, match=r"no configuration of up to 2 devices .* needs"):
        search(profile, 2, memory=1000)


def test_a_closest_configuration_whose_bound_passes_is_not_said_to_need_0_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the memory bound of the closest configuration passes (a schedule's holding
    the relaxation does not see, say) but no split fits, the message says so."""
    from autopipe.planning.configuration import search_notes

    monkeypatch.setattr(search_notes.Relaxation, "shortfall", lambda self: 0.0)
    profile = linear_profile([1.0] * 4, params=[10_000] * 4)
    with pytest.raises(PlanningError) as found:
        search(profile, 2, memory=1000)
    assert "needs at least 0 B" not in str(found.value)
    assert "holds no more than a device in all, but no split of its layers" in str(found.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"devices": 0}, "devices must be a positive integer"),
        ({"top": 0}, "top must be a positive integer"),
        ({"schedules": ("zb",)}, "plan zero bubble with autopipe.plan"),
        ({"schedules": ("zigzag",)}, "unknown schedule"),
        ({"checkpoints": ("sometimes",)}, "unknown checkpoint mode"),
        ({"batch": 0}, "batch must be a positive integer"),
        ({"max_chunks": 0}, "max_chunks must be a positive integer or None, got 0"),
        ({"bandwidth": "1e999"}, "bandwidth '1e999' is not a finite rate"),
        ({"allreduce_bandwidth": "fast"}, "cannot parse allreduce_bandwidth 'fast'"),
        ({"memory": "1e999"}, "memory '1e999' is not a finite size"),
        ({"optimizer": float("nan")}, "optimizer state factor must be a finite number"),
    ],
)
def test_bad_arguments(kwargs, message):
    profile = linear_profile([1.0] * 4)
    with pytest.raises(ValueError, match=message):
        search(profile, **{"devices": 2, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"schedules": "gpipe"},
            "schedules must be a list of names, got 'gpipe'; pass \\['gpipe'\\]",
        ),
        ({"checkpoints": "auto"}, "checkpoints must be a list of names, got 'auto'"),
        ({"checkpoints": None}, "checkpoints must be a list of names, got None$"),
        (
            {"virtual_stages": 2},
            "virtual_stages lists the stages per device to weigh, e.g. \\(1, 2\\)",
        ),
    ],
)
def test_lists_given_as_one_value(kwargs, message):
    with pytest.raises(TypeError, match=message):
        search(linear_profile([1.0] * 4), 2, **kwargs)


@pytest.mark.parametrize("profile", [None, "model.json", {"layers": []}])
def test_search_takes_a_profile(profile):
    with pytest.raises(TypeError, match="search\\(\\) takes a Profile"):
        search(profile, 2)


def test_rates_parse_like_the_command_line():
    profile = linear_profile([1.0] * 4, output=[1000] * 4)
    given = search(profile, 2, bandwidth="1kB/s", allreduce_bandwidth="1kB/s", top=2)
    assert given == search(profile, 2, bandwidth=1000.0, allreduce_bandwidth=1000.0, top=2)


def test_speed_on_a_large_profile():
    rng = np.random.default_rng(0)
    profile = random_profile(rng, 1000)
    start = time.perf_counter()
    found = search(profile, 64, memory=400_000, allreduce_bandwidth=1e5)
    elapsed = time.perf_counter() - start
    assert found and elapsed < 20  # seconds; a few on an idle laptop core


def test_expert_degrees_are_listed_or_left_to_the_rule() -> None:
    from autopipe.planning import SearchOptions
    from tests.support.mesh_profiles import block_profile, moe_profile

    fixed = dict(schedules=("gpipe",), checkpoints=("never",), top=100, micro_batch=1)
    # A listed degree makes a mesh search and is the only one weighed (with e = 1 left
    # out, every plan takes it).
    plans = search(moe_profile(4, batch=8), 8, options=SearchOptions(**fixed, expert_parallel=(2,)))
    assert plans and {p.mesh.expert for p in plans} == {2}
    # Empty: every degree the rule allows; None (the default): the same in a mesh search.
    every = search(moe_profile(4, batch=8), 8, options=SearchOptions(**fixed, expert_parallel=()))
    assert {p.mesh.expert for p in every} == {1, 2, 4}
    assert not SearchOptions().meshed and SearchOptions(expert_parallel=()).meshed
    assert not SearchOptions(expert_parallel=(1,)).meshed
    with pytest.raises(ValueError, match="needs a profile whose layers have routed experts"):
        search(block_profile(4, batch=8), 8, options=SearchOptions(**fixed, expert_parallel=(2,)))
    with pytest.raises(ValueError, match="integers >= 1"):
        search(moe_profile(4, batch=8), 8, options=SearchOptions(**fixed, expert_parallel=(0,)))


def test_v_schedules_search_re_computes_only_where_keeping_everything_is_over() -> None:
    profile = uneven_profile()
    kept = plan(profile, 4, schedule="zbv", chunks=8, checkpoint="never", optimizer="sgd")
    roomy = search(
        profile, 2, memory=int(max(kept.device_memory)), optimizer="sgd", schedules=["zbv"]
    )
    assert roomy[0].checkpoint == "never"
    cap = int(max(kept.device_memory) * 0.6)
    tight = search(profile, 2, memory=cap, optimizer="sgd", schedules=["zbv"])
    assert tight and all(p.checkpoint in ("auto", "always") for p in tight)
    assert {"units", "always"} & set(tight[0].stage_checkpoints)
    assert max(tight[0].device_memory) <= cap


def test_pipeline_depths_restrict_the_search_to_them() -> None:
    """The plans of K = 2 alone are the unrestricted search's plans of K = 2, in order."""
    profile = random_profile(np.random.default_rng(5), 8)
    options = {"memory": 12_000, "bandwidth": 300.0, "allreduce_bandwidth": 1000.0}
    every = search(profile, 4, batch=8, top=1000, **options)
    two = search(profile, 4, batch=8, top=1000, pipeline_parallel=(2,), **options)
    assert two and {p.num_stages // max(p.virtual_stages, 1) for p in two} == {2}
    expected = [p for p in every if p.num_stages // max(p.virtual_stages, 1) == 2]
    assert [(p.balance, p.step_time) for p in two] == [(p.balance, p.step_time) for p in expected]


@pytest.mark.parametrize("depths", [(), (0,), 2, (5,)])
def test_pipeline_depths_that_cannot_be_are_refused(depths: object) -> None:
    profile = random_profile(np.random.default_rng(5), 8)
    with pytest.raises(ValueError, match="pipeline"):
        search(profile, 4, batch=8, pipeline_parallel=depths)
