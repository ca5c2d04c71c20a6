"""plan and evaluate for the V schedules (zbv, dualpipev): 2K stages, two per rank, the
step replayed, the plan's JSON, trace and report."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe import PlanningError
from autopipe.output.trace_events import trace
from autopipe.planning import Plan, evaluate, plan, simulate
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.plan_settings import build_model
from autopipe.planning.model.spans import split_fits
from autopipe.planning.pipeline_settings import PipelineSettings
from autopipe.planning.split.interleaved_balance import pipeline_time
from tests.support.planning_cases import linear_profile, splits, uneven_profile

PROFILE = linear_profile([1.0, 2, 3, 1, 2, 3, 1, 2, 1, 1])


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_plan_is_the_fastest_v_split(schedule: str) -> None:
    made = plan(PROFILE, 4, schedule=schedule, chunks=4)
    assert (made.schedule, made.virtual_stages, made.checkpoint) == (schedule, 2, "never")
    assert len(made.balance) == 4 and sum(made.balance) == 10
    model: CostModel = build_model(
        PROFILE, 4, PipelineSettings(schedule=schedule, chunks=4, checkpoint="never")
    )
    best = min(pipeline_time(model, b) for b in splits(10, 4))
    assert made.step_time == pytest.approx(best, rel=1e-9)
    assert evaluate(PROFILE, made.balance, 4, schedule=schedule, chunks=4).step_time == (
        pytest.approx(made.step_time, rel=1e-12)
    )


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_plan_json_round_trips_and_traces(schedule: str, tmp_path) -> None:
    made = plan(PROFILE, 4, schedule=schedule, chunks=4)
    path = tmp_path / "plan.json"
    made.save(path)
    loaded = Plan.load(path)
    assert loaded.schedule == schedule and loaded.balance == made.balance
    events = simulate(loaded)
    assert max(e.end for e in events) == pytest.approx(made.step_time, rel=1e-9)
    threads = {
        e.get("args", {}).get("name") for e in trace(loaded)["traceEvents"] if e.get("ph") == "M"
    }
    assert "stages 0, 3" in threads and "stages 1, 2" in threads


def test_v_schedules_refuse_other_virtual_stage_counts() -> None:
    with pytest.raises(ValueError, match="2 stages per rank"):
        plan(PROFILE, 6, schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="even number of stages"):
        plan(PROFILE, 3, schedule="dualpipev", chunks=6)


RECOMPUTING = uneven_profile()


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_re_computation_makes_a_v_plan_fit_and_auto_keeps_everything_where_it_fits(
    schedule: str,
) -> None:
    options = {"schedule": schedule, "chunks": 8, "optimizer": "sgd"}
    kept = plan(RECOMPUTING, 4, checkpoint="never", **options)
    cap = int(max(kept.device_memory) * 0.6)
    with pytest.raises(PlanningError, match="fits memory"):
        plan(RECOMPUTING, 4, checkpoint="never", memory=cap, **options)
    fitted = plan(RECOMPUTING, 4, checkpoint="auto", memory=cap, **options)
    assert max(fitted.device_memory) <= cap
    assert {"units", "always"} & set(fitted.stage_checkpoints)
    assert fitted.step_time > kept.step_time  # re-computing costs time
    always = plan(RECOMPUTING, 4, checkpoint="always", memory=cap, **options)
    assert max(always.device_memory) <= cap
    assert fitted.step_time <= always.step_time * (1 + 1e-12)
    # Where each stage keeps everything within its half of the device, auto keeps
    # everything: as fast as the never plan.
    roomy = plan(RECOMPUTING, 4, checkpoint="auto", memory=2 * max(kept.device_memory), **options)
    assert set(roomy.stage_checkpoints) == {"never"}
    assert roomy.step_time == pytest.approx(kept.step_time)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_auto_is_never_refused_nor_slower_where_a_mode_for_every_stage_fits(schedule: str) -> None:
    """Each stage of a rank chooses within its share of the device: where no per-stage
    choice fits but re-computing every stage does, auto plans that."""
    options = {"schedule": schedule, "chunks": 8, "optimizer": "sgd"}
    always = plan(RECOMPUTING, 4, checkpoint="always", **options)
    kept = plan(RECOMPUTING, 4, checkpoint="never", **options)
    low, high = max(always.device_memory), max(kept.device_memory)
    for cap in np.linspace(low, high, 7).astype(int).tolist():
        fixed = [
            found
            for mode in ("never", "always")
            if (found := _fitting(RECOMPUTING, cap, checkpoint=mode, **options)) is not None
        ]
        auto = _fitting(RECOMPUTING, cap, checkpoint="auto", **options)
        assert (auto is None) == (not fixed), cap
        if auto is not None:
            assert max(auto.device_memory) <= cap
            assert auto.step_time <= min(p.step_time for p in fixed) * (1 + 1e-12)


def _fitting(profile, memory: int, **options) -> Plan | None:
    try:
        return plan(profile, 4, memory=memory, **options)
    except PlanningError:
        return None


def test_the_fastest_v_split_with_re_computation_is_found() -> None:
    model: CostModel = build_model(
        RECOMPUTING,
        4,
        PipelineSettings(schedule="zbv", chunks=8, checkpoint="auto", memory=3500, optimizer="sgd"),
    )
    fitting = [b for b in splits(8, 4) if split_fits(model, b)]
    best = min(pipeline_time(model, b) for b in fitting)
    made = plan(
        RECOMPUTING, 4, schedule="zbv", chunks=8, checkpoint="auto", memory=3500, optimizer="sgd"
    )
    assert made.step_time == pytest.approx(best + made.step_extra + made.allreduce, rel=1e-9)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_auto_is_never_slower_than_never_where_never_fits_the_rank(schedule: str) -> None:
    """Each V stage chooses within half the device, blind to its partner: auto plans
    never too and keeps the faster, so over random small cases it is never slower."""
    rng = np.random.default_rng(7 if schedule == "zbv" else 8)
    checked = 0
    for _ in range(12):
        layers = int(rng.integers(4, 8))
        profile = linear_profile(
            rng.integers(1, 10, layers).astype(float).tolist(),
            saved=rng.integers(100, 1000, layers).tolist(),
            output=rng.integers(10, 100, layers).tolist(),
            params=rng.integers(5, 50, layers).tolist(),
            batch=8,
            chunks=8,
        )
        options = {"schedule": schedule, "chunks": 8, "optimizer": "sgd"}
        roomy = plan(profile, 4, checkpoint="never", **options)
        for squeeze in (1.0, 0.9, 0.8):
            memory = int(max(roomy.device_memory) * squeeze)
            try:
                never = plan(profile, 4, checkpoint="never", memory=memory, **options)
            except PlanningError:
                continue  # never does not fit: auto may re-compute
            auto = plan(profile, 4, checkpoint="auto", memory=memory, **options)
            assert max(auto.device_memory) <= memory
            assert auto.step_time <= never.step_time * (1 + 1e-12)
            checked += 1
    assert checked >= 12
