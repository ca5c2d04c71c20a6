"""A measured step as a Chrome trace: one track per rank, named as the predicted step."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from autopipe.output.trace_events import trace
from autopipe.planning.model.plans import Plan
from tests.support.dist_models import CHUNKS
from tests.support.trace_workers import CASES, launch

WORLD = 2
COMPUTE = {"forward": "F", "backward": "B", "input": "I", "weight": "W"}


@pytest.fixture(scope="module")
def trace_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("trace")
    launch(workdir, WORLD)
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def slices(document: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in document["traceEvents"]:
        if e["ph"] == "X":
            rows[e["pid"]].append(e)
    for row in rows.values():
        row.sort(key=lambda e: e["ts"])
    return rows


@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_traced_step_equals_untraced(trace_run: list[dict[str, Any]], case: str) -> None:
    for rank in range(WORLD):
        result = trace_run[rank][case]
        assert result["equal"], f"rank {rank}: the traced step computed other numbers"
        assert result["grads"] > 0
        assert result["wrapped"] == []  # the stages' methods are their own again


@pytest.mark.parametrize("case", [name for name, *_ in CASES])
def test_measured_trace(trace_run: list[dict[str, Any]], case: str) -> None:
    result = trace_run[0][case]
    document = json.loads(Path(result["path"]).read_text())
    plan = Plan.from_dict(result["plan"])
    assert document["otherData"]["source"] == "measured"
    assert document["otherData"]["schedule"] == plan.schedule
    span = document["otherData"]["step_seconds"] * 1e6
    assert span > 0
    rows = slices(document)
    assert sorted(rows) == list(range(WORLD))  # one track per rank
    meta = {(e["pid"], e["name"]): e["args"] for e in document["traceEvents"] if e["ph"] == "M"}
    computed: set[str] = set()
    for rank, row in rows.items():
        stages = trace_run[rank][case]["stages"]
        assert meta[(rank, "process_name")]["name"] == f"rank {rank}"
        label = "stage" if len(stages) == 1 else "stages"
        assert meta[(rank, "thread_name")]["name"] == f"{label} {', '.join(map(str, stages))}"
        assert row[0]["ts"] == 0.0
        for e in row:
            assert e["dur"] >= 0 and e["ts"] + e["dur"] <= span * (1 + 1e-9)
        for a, b in itertools.pairwise(row):  # in order, tiling the step without overlap
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], rel=1e-9, abs=1e-3)
        assert sum(e["dur"] for e in row) == pytest.approx(span)
        first: dict[tuple[str, int, int], float] = {}
        for e in row:
            kind = e["args"]["kind"]
            if kind in ("idle", "post", "wait"):
                assert e["name"] == kind
                continue
            s, i = e["args"]["stage"], e["args"]["micro_batch"]
            assert s in stages and 0 <= i < CHUNKS
            head = COMPUTE.get(kind, kind)
            assert e["name"] == f"{head} s{s} mb{i}"
            assert (kind, s, i) not in first, f"{e['name']} twice"
            first[(kind, s, i)] = e["ts"]
            if kind in COMPUTE:
                computed.add(e["name"])
        backward = "input" if plan.schedule == "zb" else "backward"
        for s in stages:
            forwards = [first[("forward", s, i)] for i in range(CHUNKS)]
            assert forwards == sorted(forwards)  # micro-batches in order
            for i in range(CHUNKS):
                assert first[("forward", s, i)] < first[(backward, s, i)]
                if plan.schedule == "zb":
                    assert first[("input", s, i)] < first[("weight", s, i)]
            if s == plan.num_stages - 1:
                assert all(("loss", s, i) in first for i in range(CHUNKS))
    # The same operations as the predicted step's, under the same names: side by side.
    predicted = {
        e["name"]
        for e in trace(plan)["traceEvents"]
        if e["ph"] == "X" and e["args"]["kind"] in COMPUTE
    }
    assert computed == predicted


def test_bad_trace_path_refuses_the_step_on_every_rank(trace_run: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        assert "does not exist" in trace_run[rank]["refused"]
        assert trace_run[rank]["after refusal"]  # and the next step runs
    assert trace_run[1]["refused"].startswith("rank 0: cannot write the trace")


def test_stage_seconds_sums_a_stages_actions_per_micro_batch() -> None:
    from autopipe.distributed.step_trace import Action, median_stage_seconds, stage_seconds

    actions = [
        Action(0, 0, "forward", 0.0, 1.0),
        Action(0, 1, "forward", 1.0, 3.0),
        Action(0, 0, "backward", 3.0, 6.0),
        Action(0, 1, "input", 6.0, 7.0),  # zero bubble's halves count as the backward
        Action(0, 1, "weight", 7.0, 8.0),
        Action(0, 1, "loss", 8.0, 9.0),  # the loss is neither
        Action(-1, -1, "wait", 9.0, 10.0),  # nor are the messages
    ]
    found = stage_seconds(actions, 12.0, 10.0)
    assert found == {"stages": {0: {"forward": 1.5, "backward": 2.5}}, "step": 12.0, "span": 10.0}
    slower = stage_seconds([Action(0, 0, "forward", 0.0, 4.0)], 20.0, 15.0)
    other = stage_seconds([Action(0, 0, "forward", 0.0, 2.0)], 14.0, 11.0)
    middle = median_stage_seconds([found, slower, other])
    assert middle["stages"][0]["forward"] == 2.0
    assert (middle["step"], middle["span"]) == (14.0, 11.0)
