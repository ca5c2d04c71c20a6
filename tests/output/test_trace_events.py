"""The simulated step as a Chrome trace: the events Perfetto and chrome://tracing open."""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from autopipe.output.timeline import trace as timeline_trace
from autopipe.output.trace_events import (
    check_trace_path,
    event_name,
    trace,
    write_trace,
)
from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate
from autopipe.planning.schedules.simulation import checkpointed, makespan, simulate
from tests.support.planning_cases import linear_profile
from tests.support.timeline_cases import make_plan, virtual_plan


def zero_bubble_plan(virtual: int = 1) -> Plan:
    # Layers with parameters have weights' gradients for zero bubble to defer.
    profile = linear_profile([1.0, 2.0, 3.0, 1.0], params=[100] * 4, batch=32, chunks=4)
    return evaluate(
        profile, [1] * 4, chunks=4, schedule="zb", checkpoint="never", virtual_stages=virtual
    )


PLANS = {
    "gpipe": lambda: make_plan(
        [2, 2, 2], [1.0] * 6, checkpoint="always", bandwidth=10.0, output=[10] * 6
    ),
    # Uneven stages and sends: the simulation runs longer than the plan's formula.
    "gpipe uneven": lambda: make_plan(
        [1, 2, 3], checkpoint="except_last", bandwidth=10.0, output=[10] * 6
    ),
    "1f1b": lambda: make_plan([2, 2, 2], [1.0] * 6, schedule="1f1b", checkpoint="always"),
    "interleaved": lambda: virtual_plan(2, 2, 4, "1f1b"),
    "looped bfs": lambda: virtual_plan(2, 2, 4, "gpipe"),
    "zb": zero_bubble_plan,
    "zb interleaved": lambda: zero_bubble_plan(2),
}


def slices(document: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in document["traceEvents"] if e["ph"] == "X"]


def names(document: dict[str, Any]) -> dict[tuple[int, str], str]:
    """Metadata names by (pid, what)."""
    return {
        (e["pid"], e["name"]): e["args"].get("name")
        for e in document["traceEvents"]
        if e["ph"] == "M"
    }


@pytest.mark.parametrize("case", list(PLANS))
def test_trace_tiles_the_step(case: str) -> None:
    plan = PLANS[case]()
    document = json.loads(json.dumps(trace(plan)))  # plain JSON all through
    span = makespan(simulate(plan))
    if case != "gpipe uneven":  # these plans' simulation is their predicted step
        assert span == pytest.approx(plan.step_time)
    ranks = plan.num_stages // max(plan.virtual_stages, 1)
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in slices(document):
        rows[e["pid"]].append(e)
    assert sorted(rows) == list(range(ranks))
    eps = 1e-6 * span * 1e6
    for row in rows.values():
        row.sort(key=lambda e: e["ts"])
        assert row[0]["ts"] == 0.0
        for e in row:
            assert e["dur"] >= 0 and e["ts"] + e["dur"] <= span * 1e6 + eps
        for a, b in itertools.pairwise(row):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=eps)  # no overlap, no gap
        assert sum(e["dur"] for e in row) == pytest.approx(span * 1e6)
        assert sum(e["dur"] for e in row if e["name"] != "idle") > 0
    meta = names(document)
    for r in range(ranks):
        assert meta[(r, "process_name")] == f"device {r}"
        stages = list(range(r, plan.num_stages, ranks))
        label = meta[(r, "thread_name")]
        assert label == (f"stage {r}" if len(stages) == 1 else f"stages {r}, {r + ranks}")
    assert document["otherData"]["schedule"] == plan.schedule
    assert document["otherData"]["step_seconds"] == pytest.approx(span)
    assert document["otherData"]["step_time"] == plan.step_time


@pytest.mark.parametrize("case", list(PLANS))
def test_trace_names_every_operation(case: str) -> None:
    plan = PLANS[case]()
    document = trace(plan)
    ranks = plan.num_stages // max(plan.virtual_stages, 1)
    zb = plan.schedule == "zb"
    seen: dict[tuple[str, int, int], dict[str, Any]] = {}
    for e in slices(document):
        kind = e["args"]["kind"]
        assert e["cat"] == kind
        if kind == "idle":
            assert e["name"] == "idle"
            continue
        s, i = e["args"]["stage"], e["args"]["micro_batch"]
        assert e["pid"] == s % ranks
        letter = {"forward": "F", "recompute": "R", "input": "I", "backward": "B"}
        head = {"weight": "W", "transfer": "send", **letter}[kind]
        assert e["name"] == f"{head} s{s} mb{i}"
        assert (kind, s, i) not in seen
        seen[(kind, s, i)] = e
    backward = "input" if zb else "backward"
    for s in range(plan.num_stages):
        for i in range(plan.chunks):
            assert ("forward", s, i) in seen and (backward, s, i) in seen
            assert (("weight", s, i) in seen) == zb
            assert (("recompute", s, i) in seen) == checkpointed(plan, i, s)
            sends = plan.stages[s].transfer > 0 and s < plan.num_stages - 1
            assert (("transfer", s, i) in seen) == sends
            # The forward comes before the backward on the stage's track.
            assert seen[("forward", s, i)]["ts"] < seen[(backward, s, i)]["ts"]
    if zb:
        assert any(e["dur"] > 0 for (kind, *_), e in seen.items() if kind == "weight")
    if plan.checkpoint != "never":
        assert any(kind == "recompute" for kind, *_ in seen)


def test_trace_matches_the_simulation() -> None:
    plan = PLANS["gpipe uneven"]()
    events = simulate(plan)
    busy = [e for e in slices(trace(plan)) if e["name"] != "idle"]
    assert len(busy) == len(events)
    ours = sorted((e["args"]["stage"], e["args"]["micro_batch"], e["ts"]) for e in busy)
    theirs = sorted((e.stage, e.micro_batch, e.start * 1e6) for e in events)
    # The same (stage, micro-batch) slots in the same order, at the same times (microseconds,
    # rounded only by the trace's float formatting).
    assert [key[:2] for key in ours] == [key[:2] for key in theirs]
    assert [key[2] for key in ours] == pytest.approx([key[2] for key in theirs])


def test_event_name() -> None:
    assert event_name("forward", 2, 3) == "F s2 mb3"
    assert event_name("input", 0, 1) == "I s0 mb1"
    assert event_name("transfer", 1, 0) == "send s1 mb0"
    assert event_name("idle", 0, 0) == "idle"
    assert event_name("loss", 3, 1) == "loss s3 mb1"
    assert event_name("wait", -1, -1) == "wait"  # a measured wait belongs to no stage
    assert event_name("post", -1, -1) == "post"


def test_write_trace(tmp_path: Path) -> None:
    plan = PLANS["interleaved"]()
    path = tmp_path / "step.json"
    write_trace(plan, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace(plan)))
    assert os.listdir(tmp_path) == ["step.json"]  # no temporary file left
    assert timeline_trace is trace


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("step.png", "use a .json file name"),
        ("missing/step.json", "does not exist"),
    ],
)
def test_bad_trace_path(tmp_path: Path, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_trace(make_plan([3, 3]), tmp_path / name)
    with pytest.raises(ValueError, match="is a directory"):
        check_trace_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_package_names_the_timeline_module() -> None:
    import autopipe
    from autopipe.output import timeline, trace_events

    assert autopipe.timeline is timeline
    assert autopipe.timeline.trace is trace_events.trace
    assert "timeline" in dir(autopipe)
