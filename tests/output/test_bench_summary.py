"""Tests of the step benchmark's numbers (autopipe.output.bench_summary) and its report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from autopipe.output.bench_report import draw_bench, render_bench
from autopipe.output.bench_summary import (
    Measured,
    bench_record,
    bounding_unit,
    ideal_step,
    median_spread,
    merge_stage_seconds,
    speedups,
    summarize,
    unit_costs,
)
from autopipe.planning.planner import evaluate, plan
from tests.support.planning_cases import linear_profile


def test_ideal_step_spreads_the_total_work() -> None:
    # Σc = 6 over K = 3 stages is 2 per stage; M = 4 micro-batches: 2 · (4 + 3 − 1) = 12.
    assert ideal_step([1.0, 2.0, 3.0], 4) == pytest.approx(12.0)
    # A balanced split reaches it: GPipe's Σc + (M−1)·max c.
    assert ideal_step([2.0, 2.0], 3) == pytest.approx(4.0 + 2 * 2.0)
    assert ideal_step([5.0], 1) == pytest.approx(5.0)


def test_ideal_step_is_a_lower_bound_of_gpipe() -> None:
    for costs, chunks in [([1.0, 4.0], 3), ([3.0, 1.0, 2.0], 8)]:
        gpipe = sum(costs) + (chunks - 1) * max(costs)
        assert ideal_step(costs, chunks) <= gpipe


def test_ideal_step_refuses_nothing_to_spread() -> None:
    with pytest.raises(ValueError, match="at least one stage"):
        ideal_step([], 4)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        ideal_step([1.0], 0)


def test_merge_stage_seconds_takes_each_stage_from_its_rank() -> None:
    first = {"stages": {0: {"forward": 1.0, "backward": 2.0}}, "step": 5.0, "span": 4.0}
    second = {"stages": {1: {"forward": 3.0, "backward": 4.0}}, "step": 6.0, "span": 3.0}
    merged = merge_stage_seconds([first, second])
    assert merged == {
        "stages": [{"forward": 1.0, "backward": 2.0}, {"forward": 3.0, "backward": 4.0}],
        "step": 6.0,
        "span": 4.0,
    }
    # The unrecorded steps the fit of the runner's cost per step reads: each step's
    # slowest rank.
    first["steps"], second["steps"] = [5.0, 7.0], [6.0, 6.5]
    assert merge_stage_seconds([first, second])["steps"] == [6.0, 7.0]  # type: ignore[index]
    # A rank that recorded nothing: nothing to merge.
    assert merge_stage_seconds([first, None]) is None
    assert merge_stage_seconds([]) is None


def test_median_spread() -> None:
    median, spread = median_spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert median == 3.0
    assert spread == pytest.approx((4.0 - 2.0) / 3.0)
    assert median_spread([2.0]) == (2.0, 0.0)
    with pytest.raises(ValueError, match="no step times"):
        median_spread([])


def test_bounding_unit_is_the_heaviest_over_a_share() -> None:
    units = [("a", 1.0), ("b", 5.0), ("c", 1.0)]
    # Σc/K = 7/2 = 3.5 < 5: unit b bounds the ideal.
    assert bounding_unit(units, [6.0, 1.0]) == ("b", 5.0)
    # Σc/K = 7 / 1: nothing bounds.
    assert bounding_unit(units, [7.0]) is None
    assert bounding_unit([], [1.0]) is None


def test_unit_costs_follow_the_profile() -> None:
    profile = linear_profile([1.0, 2.0, 3.0], chunks=2)
    costs = unit_costs(profile, 2, chunks=2, checkpoint="never", optimizer="sgd")
    assert [name for name, _ in costs] == ["l0", "l1", "l2"]
    # forward + backward (twice the forward) per micro-batch, no re-computation.
    assert [cost for _, cost in costs] == pytest.approx([3.0, 6.0, 9.0])


def _summaries() -> list:
    profile = linear_profile([1.0, 1.0, 6.0], chunks=2)
    options: dict[str, Any] = {"chunks": 2, "checkpoint": "never", "optimizer": "sgd"}
    best = plan(profile, 2, **options)
    given = evaluate(profile, [1, 2], 2, strategy="given", **options)
    costs = unit_costs(profile, 2, **options)
    return [
        summarize("optimal", best, Measured([1.0, 2.0, 3.0], [10, None]), costs),
        summarize("given", given, Measured([4.0, 6.0, 8.0], [None, None]), costs),
    ]


def test_summarize_and_speedups() -> None:
    best, given = _summaries()
    assert best.balance == [2, 1] and given.balance == [1, 2]
    assert best.measured == 2.0 and given.measured == 6.0
    assert best.steps == 3
    # Stage costs 6 and 18 per micro-batch, M = 2: ideal 24/2 · 3 = 36.
    assert best.stage_times == pytest.approx([6.0, 18.0])
    assert best.ideal == pytest.approx(36.0)
    assert best.over_ideal == pytest.approx(2.0 / 36.0)
    assert best.over_predicted == pytest.approx(2.0 / best.predicted)
    # Unit l2 (18 per micro-batch) is heavier than the share 12.
    assert best.bound_unit == ("l2", pytest.approx(18.0))
    assert speedups([best, given]) == {
        "optimal": {"given": pytest.approx(3.0)},
        "given": {"optimal": pytest.approx(1 / 3)},
    }


def test_bench_record_is_json() -> None:
    summaries = _summaries()
    record = json.loads(json.dumps(bench_record(summaries, {"stages": 2})))
    assert record["settings"] == {"stages": 2}
    first = record["splits"][0]
    assert first["label"] == "optimal" and first["saved_peak"] == [10, None]
    assert first["bound_unit"]["name"] == "l2"
    assert first["measured_over_ideal"] == pytest.approx(first["measured"] / first["ideal"])
    assert record["speedups"]["optimal"]["given"] == pytest.approx(3.0)


def test_render_bench_names_every_split_and_the_bound() -> None:
    text = render_bench(_summaries(), "a header")
    lines = text.splitlines()
    assert lines[0] == "a header"
    assert lines[1].split()[:4] == ["split", "balance", "measured", "spread"]
    assert lines[2].startswith("optimal") and "[2, 1]" in lines[2]
    assert "3.00x" in text  # optimal over given
    assert "unit l2 costs 18 s per micro-batch" in text


def test_draw_bench(tmp_path: Path) -> None:
    path = tmp_path / "bench.svg"
    draw_bench(_summaries(), path)
    assert "<svg" in path.read_text()
    with pytest.raises(ValueError):
        draw_bench(_summaries(), tmp_path / "bench.txt")
