"""The balance suite's parts: memory-limit choice, round-robin stage timing, the report."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from autopipe import PlanningError, plan
from autopipe.planning.planner import evaluate
from benchmarks.balance import suite
from benchmarks.balance.memory_limit import choose_limit, least_capacity, peak_memory
from benchmarks.balance.stage_timing import StageTimer, summarize
from benchmarks.models import ZOO
from profiler.profile import Profile
from tests.support.planning_cases import linear_profile


def _skewed() -> Profile:
    """Four layers of 100 parameter bytes; the last one is 3x slower.

    The fastest 2-stage split is [3, 1] (equal times), whose first stage holds 3 layers'
    state: 3 x 100 x (2 + 2 Adam) = 1200 bytes. The split needing the least memory is
    [2, 2] at 800 bytes.
    """
    return linear_profile([1.0, 1.0, 1.0, 3.0], params=[100] * 4)


def test_limit_binds_and_fits_on_a_known_profile() -> None:
    profile = _skewed()
    best = plan(profile, 2)
    assert best.balance == [3, 1] and peak_memory(best) == 1200
    limit = choose_limit(profile, 2)
    assert limit.least == 800 and limit.binding
    assert limit.least <= limit.limit < limit.unconstrained_peak == 1200
    # A plan exists at the limit, and it is not the unconstrained optimal split.
    limited = plan(profile, 2, memory=limit.limit)
    assert limited.balance == [2, 2]
    assert peak_memory(limited) <= limit.limit
    assert peak_memory(evaluate(profile, best.balance, memory=limit.limit)) > limit.limit
    # The least capacity is exact: one byte less and the planner finds nothing.
    with pytest.raises(PlanningError):
        plan(profile, 2, memory=limit.least - 1)


def test_limit_falls_back_to_midpoint_below_the_peak() -> None:
    limit = choose_limit(_skewed(), 2, margin=10.0)
    assert limit.binding and limit.limit == (800 + 1199) // 2


def test_limit_does_not_bind_when_optimal_already_needs_least_memory() -> None:
    profile = linear_profile([1.0] * 4, params=[100] * 4)
    limit = choose_limit(profile, 2)
    assert not limit.binding
    assert limit.limit == limit.least == limit.unconstrained_peak == 800
    plan(profile, 2, memory=limit.limit)


def test_least_capacity_refuses_an_infeasible_upper_bound() -> None:
    with pytest.raises(ValueError, match="no split"):
        least_capacity(_skewed(), 2, 799)


def test_summarize_quartiles_and_spread() -> None:
    timing = summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (timing.q1, timing.median, timing.q3, timing.repeats) == (2.0, 3.0, 4.0, 5)
    assert timing.spread == pytest.approx(2.0 / 3.0) and timing.low == 1.0
    assert summarize([2.0]).spread == 0.0
    with pytest.raises(ValueError):
        summarize([])


def _tiny_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _tiny_sample() -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def test_stage_timer_takes_one_sample_per_round_and_job() -> None:
    timer = StageTimer(_tiny_sequential(), (_tiny_sample(),))
    jobs = [(0, 2, 2, True), (2, 5, 2, True), (2, 5, 2, False)]
    timer.run(jobs, repeats=3)
    assert {job: len(s) for job, s in timer.samples.items()} == dict.fromkeys(jobs, 3)
    timing = timer.stage(2, 5, 2, recompute=0.75)
    assert timing.repeats == 3 and timing.q1 <= timing.median <= timing.q3
    # Gradients of the timed stages are cleared, so timing leaves the model as it was.
    assert all(p.grad is None for p in timer.units[2].parameters())
    with pytest.raises(KeyError):
        timer.stage(0, 2, 2, recompute=0.5)  # its no-grad forward was never timed


def test_suite_writes_report_tables_and_pictures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    tiny = types.ModuleType("tiny")
    tiny.model = _tiny_sequential  # type: ignore[attr-defined]
    tiny.sample = _tiny_sample  # type: ignore[attr-defined]
    monkeypatch.setitem(ZOO, "tiny", tiny)
    argv = ["--quick", "--models", "tiny", "--stages", "2,4", "--repeats", "2"]
    assert suite.main([*argv, "--out", str(tmp_path)]) == 0

    report = (tmp_path / "balance.md").read_text()
    for heading in (
        "## Measured bottleneck / optimal's measured bottleneck, K=4",
        "## Memory-aware optimal: the limit and what it costs",
        "## Planning time per strategy (ms)",
        "## Every plan",
        "## GPipe Table 2 in our terms: normalized throughput",
        "## Pipeline timelines, optimal split, K=4, M=4",
    ):
        assert heading in report
    for picture in ("balance_tiny.png", "timeline_tiny.png"):
        assert (tmp_path / picture).stat().st_size > 0
        assert f"({picture})" in report
    assert "2 rounds" in report and f"{torch.__version__}" in report

    results = json.loads((tmp_path / "balance.json").read_text())
    assert results["repeats"] == 2 and results["machine"]["cpus"] >= 1
    (model,) = results["models"]
    assert set(model["memory_limits"]) == {"2", "4"}
    rows = {(r["stages"], r["strategy"]): r for r in model["rows"]}
    assert len(rows) == 2 * len(suite.LABELS)
    for k in (2, 4):
        limited, limit = rows[(k, "optimal (memory)")], model["memory_limits"][str(k)]
        assert limited["fits"] and max(limited["stage_memory"]) <= limit["limit"]
        assert len(limited["measured_stage_timings"]) == k
        assert rows[(k, "optimal")]["measured_ratio"] == 1.0
