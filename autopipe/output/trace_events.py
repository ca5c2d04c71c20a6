"""A pipeline step as a Chrome trace (trace-event JSON), for Perfetto and chrome://tracing.

:func:`trace` writes the step :func:`autopipe.planning.schedules.simulation.simulate` predicts for a
plan; the distributed runner writes the step it measures with :func:`trace_document` in
the same form, so that both open side by side. One process (``pid``) per device, named by
metadata events (``"ph": "M"``); each operation is a complete event (``"ph": "X"``, ``ts``
and ``dur`` in microseconds from the step's start) named by kind, stage and micro-batch:
``F s2 mb3`` a forward, ``R`` its re-computation, ``B`` a backward (``I`` the input's
gradient under zero bubble), ``W`` the weights' gradient, ``send`` a stage sending its
output; measured steps also have ``loss s3 mb1`` (the last stage's loss), ``post`` (a
rank posting a batch of sends and receives) and ``wait`` (waiting for them). ``args``
holds ``stage``, ``micro_batch`` and ``kind`` (``kind`` only, for ``idle``, ``post`` and
``wait``). The time a device spends on nothing
is an ``idle`` event, so each device's events tile the step from its start to its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from autopipe.planning import Plan, makespan, rank_stages, simulate, stage_placement

__all__ = [
    "Track",
    "check_trace_path",
    "stages_label",
    "trace",
    "trace_document",
    "write_trace",
    "write_trace_document",
]

# The letter an operation's name starts with, by kind (``backward`` depends on the schedule).
_LETTERS = {"forward": "F", "recompute": "R", "backward": "B", "input": "I", "weight": "W"}
_NAMED = {"transfer": "send", "loss": "loss"}
_US = 1e6  # trace-event times are microseconds


class Timed(Protocol):
    """An operation of a step: what runs, and when (seconds from the step's start)."""

    @property
    def stage(self) -> int: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...


@dataclass(frozen=True)
class Track:
    """One device's row of a trace.

    Attributes:
        name: the process name, e.g. ``device 0`` or ``rank 1``.
        label: the thread name under it, e.g. ``stage 0`` or ``stages 0, 2``.
        events: the device's operations; they must not overlap.
    """

    name: str
    label: str
    events: Sequence[Timed]


def event_name(kind: str, stage: int, micro_batch: int) -> str:
    """The trace name of an operation: ``F s2 mb3``, ``send s0 mb1``, ``idle``.

    Args:
        kind: ``forward``, ``recompute``, ``backward``, ``input`` (zero bubble's input
            gradient), ``weight``, ``transfer``, ``loss``, ``post``, ``wait`` or ``idle``.
        stage: the stage that runs it; negative for an operation of no stage (``post``,
            ``wait``).
        micro_batch: its micro-batch.
    """
    if kind == "idle" or stage < 0:
        return _NAMED.get(kind, kind)
    head = _LETTERS.get(kind) or _NAMED.get(kind, kind)
    return f"{head} s{stage} mb{micro_batch}"


def stages_label(stages: Sequence[int]) -> str:
    """``stage 0`` or ``stages 0, 2``: the thread name of a device holding ``stages``."""
    if len(stages) == 1:
        return f"stage {stages[0]}"
    return "stages " + ", ".join(str(s) for s in stages)


def _slice(pid: int, name: str, kind: str, start: float, end: float, **args: int) -> dict[str, Any]:
    return {
        "name": name,
        "cat": kind,
        "ph": "X",
        "pid": pid,
        "tid": 0,
        "ts": start * _US,
        "dur": (end - start) * _US,
        "args": {**args, "kind": kind},
    }


def trace_document(
    tracks: Sequence[Track], span: float, metadata: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Tracks of timed operations as a trace-event JSON object.

    Args:
        tracks: one per device, in order; track ``p`` is process ``p``.
        span: seconds of the step: each track's idle events fill it up to its end.
        metadata: more about the step, kept under ``otherData``.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``.
    """
    out: list[dict[str, Any]] = []
    for pid, track in enumerate(tracks):
        out.append(_meta(pid, "process_name", track.name))
        out.append({**_meta(pid, "process_sort_index", ""), "args": {"sort_index": pid}})
        out.append(_meta(pid, "thread_name", track.label))
        clock = 0.0
        for e in sorted(track.events, key=lambda e: (e.start, e.end)):
            if e.start > clock:
                out.append(_slice(pid, "idle", "idle", clock, e.start))
            name = event_name(e.kind, e.stage, e.micro_batch)
            where = {"stage": e.stage, "micro_batch": e.micro_batch} if e.stage >= 0 else {}
            out.append(_slice(pid, name, e.kind, e.start, e.end, **where))
            clock = max(clock, e.end)
        if span > clock:
            out.append(_slice(pid, "idle", "idle", clock, span))
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"step_seconds": span, **(metadata or {})},
    }


def _meta(pid: int, what: str, name: str) -> dict[str, Any]:
    return {"name": what, "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}


@dataclass(frozen=True)
class _Op:
    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float


def trace(plan: Plan) -> dict[str, Any]:
    """The simulated step of ``plan`` as a trace-event JSON object (see the module).

    One track per device (``device r``, holding stages ``r, r+K, …``); its events tile the
    simulated step, so their durations add up to its makespan (the plan's ``step_time``
    where the simulation agrees with it, see :mod:`autopipe.planning.schedules.simulation`). Under
    zero bubble a backward is the input's gradient, ``I``.

    Args:
        plan: the plan.

    Raises:
        ValueError: as :func:`autopipe.planning.schedules.simulation.simulate`.
    """
    events = simulate(plan)
    virtual = max(plan.virtual_stages, 1)
    ranks = plan.num_stages // virtual
    where = stage_placement(plan.num_stages, ranks, plan.schedule)
    rows: list[list[Timed]] = [[] for _ in range(ranks)]
    for e in events:
        split = plan.schedule in ("zb", "zbv", "dualpipev")
        kind = "input" if e.kind == "backward" and split else e.kind
        rows[where[e.stage]].append(_Op(e.stage, e.micro_batch, kind, e.start, e.end))
    tracks = [
        Track(f"device {r}", stages_label(rank_stages(r, ranks, virtual, plan.schedule)), rows[r])
        for r in range(ranks)
    ]
    metadata = {
        "source": "predicted",
        "balance": list(plan.balance),
        "schedule": plan.schedule,
        "virtual_stages": max(plan.virtual_stages, 1),
        "chunks": plan.chunks,
        "checkpoint": plan.checkpoint,
        "step_time": plan.step_time,
    }
    return trace_document(tracks, makespan(events), metadata)


def check_trace_path(path: str | os.PathLike[str]) -> None:
    """Fails when a trace cannot be written to ``path``.

    Raises:
        ValueError: ``path`` does not end in ``.json``, is a directory, or its directory
            is missing or not writable.
    """
    target = Path(path)
    where = f"cannot write the trace to {os.fspath(path)}"
    if target.is_dir():
        raise ValueError(f"{where}: it is a directory")
    if target.suffix.lower() != ".json":
        raise ValueError(f"{where}: use a .json file name (Perfetto and chrome://tracing read it)")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{where}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{where}: directory {parent} is not writable")


def write_trace_document(document: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes a trace-event object to ``path`` atomically: a failure leaves no partial file.

    Raises:
        OSError: the file cannot be written (the message names it).
    """
    target = Path(path)
    text = json.dumps(document, separators=(",", ":"))
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException as exc:  # KeyboardInterrupt too: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OSError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None
        raise


def write_trace(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Writes :func:`trace` of ``plan`` to ``path`` (a ``.json`` file), atomically.

    Raises:
        ValueError: ``path`` is not a writable ``.json`` file name, or as :func:`trace`.
        OSError: the file cannot be written.
    """
    check_trace_path(path)
    write_trace_document(trace(plan), path)
