"""A measured pipeline step as a Chrome trace: each rank's actions, gathered to rank 0.

:class:`StepRecorder` times one step of a torch pipelining schedule on this rank: it wraps
the ``PipelineStage`` methods every schedule calls (``forward_one_chunk``,
``backward_one_chunk``, ``backward_weight_one_chunk``), the schedule's loss, and torch's
calls that post batches of sends and receives and wait for them, for the step only. The
wrappers only read the clock (on CUDA after synchronizing the device, so that an action's
end is its kernels'), so the step computes exactly what it computes untraced. The ranks
start from a barrier, each counting from when it leaves it, and rank 0 writes one trace
with one track per rank, named as :func:`autopipe.output.trace_events.trace` names the
predicted step: ``F s1 mb2``, ``B``, ``I`` and ``W`` (zero bubble's halves), ``loss``,
then ``post`` for time spent posting sends and receives (gloo may block there until the
peer is ready) and ``wait`` for time waiting for them. A backward includes the forward's
re-computation, if any. The first step of a pipeline also sets up torch's stages: trace a
later one.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from autopipe.distributed.collectives import collective
from autopipe.output import Track, stages_label, trace_document, write_trace_document
from autopipe.planning import Plan

__all__: list[str] = []

# torch's calls that post a batch of sends and receives, and that wait for them
_POST = ("_batch_p2p", "_sorted_batch_p2p")
_WAIT = "_wait_batch_p2p"


@dataclass(frozen=True)
class Action:
    """One timed action of this rank: seconds since the ranks left the barrier."""

    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float


class StepRecorder:
    """Records this rank's actions during one step; a context manager around the step.

    Args:
        stages: this rank's ``PipelineStage`` objects.
        schedule: the torch schedule that runs them.
        device: this rank's device (CUDA is synchronized before each clock reading).
        group: the process group of every rank that records (the barrier's and gather's).
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Any,
        device: torch.device,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.stages, self.schedule, self.device, self.group = stages, schedule, device, group
        self.actions: list[Action] = []
        self.stop = 0.0
        self._zero = 0.0
        self._depth = 0  # actions under way: a wait inside one is part of it
        self._undo: list[Callable[[], None]] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._zero

    def _timed(
        self, function: Callable[..., Any], kind: Callable[..., tuple[int, int, str] | None]
    ) -> Any:
        """``function`` recording an action of ``kind(*args, **kwargs)`` (``None``: not
        recorded) from its call to its return."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            what = kind(*args, **kwargs) if self._depth == 0 else None
            if what is None:
                return function(*args, **kwargs)
            stage, micro_batch, name = what
            self._depth += 1
            start = self._now()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth -= 1
                self.actions.append(Action(stage, micro_batch, name, start, self._now()))

        return wrapper

    def _patch(self, owner: Any, name: str, kind: Callable[..., Any]) -> None:
        had = name in vars(owner)
        original = vars(owner)[name] if had else None
        setattr(owner, name, self._timed(getattr(owner, name), kind))
        if had:
            self._undo.append(lambda: setattr(owner, name, original))
        else:  # a bound method: removing the wrapper shows the class's again
            self._undo.append(lambda: delattr(owner, name))

    def __enter__(self) -> StepRecorder:
        barrier = torch.zeros(1, device=self.device)
        collective(
            dist.get_rank(self.group),
            "start the traced step",
            dist.all_reduce,
            barrier,
            group=self.group,
        )
        self._zero = 0.0
        self._zero = self._now()
        for stage in self.stages:
            index = stage.stage_index

            def forward(chunk: int, *_: Any, index: int = index, **__: Any) -> Any:
                return index, chunk, "forward"

            def backward(chunk: int, *args: Any, index: int = index, **kw: Any) -> Any:
                full = kw.get("full_backward", args[1] if len(args) > 1 else True)
                return index, chunk, "backward" if full else "input"

            def weight(chunk: int, *_: Any, index: int = index, **__: Any) -> Any:
                return index, chunk, "weight"

            self._patch(stage, "forward_one_chunk", forward)
            self._patch(stage, "backward_one_chunk", backward)
            self._patch(stage, "backward_weight_one_chunk", weight)

        def loss(stage: Any, output: Any, target: Any, chunk: int, *_: Any, **__: Any) -> Any:
            return (stage.stage_index, chunk, "loss") if stage.is_last else None

        if hasattr(self.schedule, "_maybe_compute_loss"):
            self._patch(self.schedule, "_maybe_compute_loss", loss)
        for name in _POST:
            self._patch(torch_schedules, name, lambda *_, **__: (-1, -1, "post"))
        self._patch(torch_schedules, _WAIT, lambda *_, **__: (-1, -1, "wait"))
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop = self._now()
        while self._undo:
            self._undo.pop()()

    def write(self, path: str | os.PathLike[str], plan: Plan, label: str) -> None:
        """Gathers every rank's actions to rank 0, which writes the trace; a collective.

        Args:
            path: the ``.json`` file rank 0 writes (atomically).
            plan: the pipeline's plan, for the trace's notes.
            label: this rank's track label, e.g. ``stage 1`` or ``stages 1, 3``.
        """
        rank = dist.get_rank(self.group)
        mine = (label, [tuple(vars(a).values()) for a in self.actions], self.stop)
        world = dist.get_world_size(self.group)
        parts: list[Any] | None = [None] * world if rank == 0 else None
        target = dist.get_global_rank(self.group or dist.group.WORLD, 0)  # type: ignore[arg-type]
        collective(
            rank,
            "gather the step's trace",
            dist.gather_object,
            mine,
            parts,
            dst=target,
            group=self.group,
        )
        if parts is None:
            return
        tracks = [
            Track(f"rank {r}", name, [Action(*a) for a in actions])
            for r, (name, actions, _) in enumerate(parts)
        ]
        span = max(stop for _, _, stop in parts)
        metadata = {
            "source": "measured",
            "balance": list(plan.balance),
            "schedule": plan.schedule,
            "virtual_stages": max(plan.virtual_stages, 1),
            "chunks": plan.chunks,
            "checkpoint": plan.checkpoint,
            "step_time": plan.step_time,
        }
        write_trace_document(trace_document(tracks, span, metadata), path)


def track_label(stages: Sequence[int], replica: int, replicas: int) -> str:
    """``stage 1``, ``stages 1, 3``, or with replicas ``stage 1, replica 0``."""
    label = stages_label(stages)
    return f"{label}, replica {replica}" if replicas > 1 else label


def stage_seconds(actions: Sequence[Action], step: float, span: float) -> dict[str, Any]:
    """One rank's recorded step in figures.

    Returns:
        ``{"stages": {stage: {"forward": s, "backward": s}}, "step": s, "span": s}``: per
        stage the mean seconds per micro-batch of its forward and of its backward (the
        re-computation and zero bubble's two halves included), the step's seconds and
        the seconds the recorder held (``span``: from the ranks' barrier to its exit).
    """
    sums: dict[int, dict[str, float]] = {}
    counts: dict[int, int] = {}
    for action in actions:
        if action.stage < 0 or action.kind == "loss":
            continue
        kind = "forward" if action.kind == "forward" else "backward"
        totals = sums.setdefault(action.stage, {"forward": 0.0, "backward": 0.0})
        totals[kind] += action.end - action.start
        counts[action.stage] = counts.get(action.stage, 0) + (kind == "forward")
    stages = {
        index: {kind: total / max(counts[index], 1) for kind, total in totals.items()}
        for index, totals in sums.items()
    }
    return {"stages": stages, "step": step, "span": span}


def median_stage_seconds(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several steps' :func:`stage_seconds` as one: each figure's median over the steps."""
    stages: dict[int, dict[str, float]] = {}
    for index in records[0]["stages"]:
        stages[index] = {
            kind: statistics.median(r["stages"][index][kind] for r in records)
            for kind in records[0]["stages"][index]
        }
    return {
        "stages": stages,
        "step": statistics.median(r["step"] for r in records),
        "span": statistics.median(r["span"] for r in records),
    }
