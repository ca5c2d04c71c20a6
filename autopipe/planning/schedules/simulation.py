"""A plan's pipeline schedule as timed events: a discrete-event simulation of one step.

:func:`simulate` replays one training step of a :class:`~autopipe.planning.model.plans.Plan` as a
small discrete-event simulation. Each device runs its operations in the schedule's order
(GPipe fill–drain or 1F1B; with virtual stages torch's looped BFS or interleaved 1F1B,
stage ``k`` on device ``k mod K``, see :mod:`autopipe.planning.schedules.schedule_replay`); an
operation starts when its device is free and its input has arrived. Per micro-batch, stage ``k``
spends:

- ``f_k`` on a forward, then ``t_k`` sending its output to stage ``k+1`` (the stage is busy
  while it sends, as the cost model charges the send to the stage's time);
- ``f_k`` on a recompute right before the backward of every checkpointed micro-batch
  (``always``: all, ``except_last``: all but the one whose backward comes first — the last
  under GPipe's reversed backwards, the first under 1F1B's — ``never``: none);
- ``b_k`` on a backward, whose input gradient arrives at stage ``k-1`` when it ends (the
  cost model charges one send per micro-batch, so the gradient's trip back is free here).

``f_k`` is the planner's forward and ``b_k`` the rest of the plan's ``compute`` (plans
that predate it split ``compute`` in the profile's forward:backward ratio, 1:2 without a
profile), so that ``f_k·(1 + r) + b_k + t_k`` is exactly the plan's stage time ``c_k``.

With virtual stages the plan's ``step_time`` is this replay. With one stage per device
the simulated makespan relates to the plan's ``step_time = Σc + (M−1)·max c`` (GPipe's
formula, which the planner uses for both schedules) as follows:

- GPipe, ``checkpoint`` ``always`` or ``never``: equal when each stage's forward (with its
  send) and backward (with its recompute) are in the same proportion on every stage, e.g.
  free transfers and layers whose backward is a fixed multiple of their forward; otherwise
  larger, because forwards and backwards run as two separate phases: the simulation pays
  ``max f + max b`` where the formula pays ``max (f + b)``.
- GPipe, ``except_last``: for such proportional stages, within ``(M+K−1)/M · max f``
  (about one forward) of the formula. The formula spreads the recompute evenly over the M
  micro-batches; in the schedule the one micro-batch that is not recomputed goes backward
  first. With balanced stages the simulation is longer by exactly ``(K−1)·f/M``.
- 1F1B: the same as GPipe when stages are balanced (``always`` or ``never``); with
  unbalanced stages often shorter, since a stage's backwards need not wait for every
  forward of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autopipe.planning.schedules.interleaving import spared
from autopipe.planning.schedules.schedule_replay import (
    ALL_BUT_ONE,
    NONE,
    RECOMPUTE_CODES,
    Operation,
    hidden_seconds,
    hidden_share,
    recomputes,
    replay_order,
)

# Only annotations name a Plan: schedules sit below the plans they replay (see the package).
if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__ = ["KINDS", "checkpointed", "makespan", "simulate", "stage_times"]

KINDS = ("forward", "recompute", "backward", "weight", "transfer")
# Backward takes about twice the forward (gradients of inputs and of weights).
_DEFAULT_BACKWARD_RATIO = 2.0


@dataclass(frozen=True)
class Event:
    """One operation of the simulated step.

    Attributes:
        stage: the stage that runs it.
        micro_batch: the micro-batch it works on, from 0.
        kind: ``forward``, ``recompute``, ``backward`` (under zero bubble: the input's
            gradient), ``weight`` (zero bubble's deferred weight gradients) or ``transfer``
            (the stage sending its forward output to the next stage).
        start: seconds from the start of the step.
        end: seconds from the start of the step.
    """

    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spends per micro-batch on each kind of operation.

    Attributes:
        forward: one forward (also the length of one recompute).
        backward: one backward.
        transfer: sending one forward output to the next stage.
        recompute_fraction: share of micro-batches recomputed, so that
            ``forward·(1 + recompute_fraction) + backward + transfer`` is the plan's
            stage time.
        weight: of ``backward``, the weights' gradients (zero bubble runs them apart).
        comm_forward: of ``forward``, the all-to-alls ``dualpipev``'s overlapped pairs
            hide in part (:mod:`autopipe.planning.schedules.schedule_replay`).
        comm_backward: of ``backward``, the same.
    """

    forward: float
    backward: float
    transfer: float
    recompute_fraction: float
    weight: float = 0.0
    comm_forward: float = 0.0
    comm_backward: float = 0.0

    @property
    def recompute(self) -> float:
        """Recompute seconds per micro-batch on average."""
        return self.forward * self.recompute_fraction

    @property
    def total(self) -> float:
        """The stage's cost per micro-batch, as in the plan."""
        return self.forward + self.recompute + self.backward + self.transfer


def checkpointed(plan: Plan, micro_batch: int, stage: int = 0) -> bool:
    """Whether ``micro_batch`` recomputes its forward in backward on ``stage``.

    ``except_last`` spares the micro-batch whose backward the stage runs first
    (:func:`autopipe.planning.schedules.interleaving.spared`): the last under GPipe's reversed
    backwards, the first under 1F1B's. A plan with ``checkpoint="auto"`` chooses the mode per stage.
    """
    modes = plan.stage_checkpoints if plan.stages else [plan.checkpoint]
    mode = modes[min(stage, len(modes) - 1)]
    code = RECOMPUTE_CODES.get(mode, NONE)
    if code != ALL_BUT_ONE:  # the spared micro-batch matters only to except_last
        return bool(recomputes(code, micro_batch, -1))
    virtual = max(plan.virtual_stages, 1)
    first = spared(max(plan.num_stages // virtual, 1), virtual, plan.chunks, plan.schedule)
    return bool(recomputes(code, micro_batch, first[min(stage, len(first) - 1)]))


def _recompute_fraction(plan: Plan, stage: int) -> float:
    m = plan.chunks
    return sum(checkpointed(plan, i, stage) for i in range(m)) / m


def _layer_times(plan: Plan) -> tuple[list[float], list[float]] | None:
    """Per-layer forward and backward seconds at the plan's micro-batch, if it has a profile."""
    if not plan.profile:
        return None
    # Imported here: the profile module is light, but plans loaded without one need none.
    from profiler import Profile

    try:
        profile = Profile.from_dict(plan.profile)
    except (ValueError, KeyError, TypeError):
        return None
    n = len(profile)
    if n < max(stage.stop for stage in plan.stages):
        return None
    forward = [profile.predict(i, "forward", plan.micro_batch) for i in range(n)]
    backward = [profile.predict(i, "backward", plan.micro_batch) for i in range(n)]
    return forward, backward


def stage_times(plan: Plan) -> list[StageTimes]:
    """Splits each stage's predicted time into forward, recompute, backward and transfer.

    The forward is the planner's (``StagePlan.forward``) and the backward the rest of the
    stage's ``compute``. Plans without it take the forward:backward ratio from their
    profile (device speed divides both, so it cancels) and scale the parts to add up to the
    plan's ``compute`` exactly; without a usable profile, backward is taken as twice the
    forward.

    Args:
        plan: the plan.

    Returns:
        One entry per stage.
    """
    layers = None if all(stage.forward > 0 for stage in plan.stages) else _layer_times(plan)
    out = []
    for stage in plan.stages:
        r = _recompute_fraction(plan, stage.index)
        rest = stage.compute - stage.forward * (1.0 + r)
        if stage.forward > 0 and rest >= 0:
            weight = min(stage.weight, rest)
            comm = (min(stage.alltoall_forward, stage.forward), min(stage.alltoall_backward, rest))
            out.append(StageTimes(stage.forward, rest, stage.transfer, r, weight, *comm))
            continue
        f, b = 1.0, _DEFAULT_BACKWARD_RATIO
        if layers is not None:
            # A segment can dip below zero for a tiny layer; a stage's sum rarely does.
            lf = max(sum(layers[0][stage.start : stage.stop]), 0.0)
            lb = max(sum(layers[1][stage.start : stage.stop]), 0.0)
            if lf + lb > 0:
                f, b = lf, lb
        scale = stage.compute / (f * (1.0 + r) + b)
        out.append(StageTimes(f * scale, b * scale, stage.transfer, r))
    return out


def _ranks(plan: Plan) -> int:
    """Devices of the pipeline: K, each holding ``virtual_stages`` of the plan's stages."""
    return plan.num_stages // max(plan.virtual_stages, 1)


def simulate(plan: Plan) -> list[Event]:
    """Simulates one training step of ``plan`` under its schedule.

    Each device runs its operations in the order
    :func:`autopipe.planning.schedules.interleaving.rank_order` gives (GPipe fill–drain or 1F1B;
    with virtual stages torch's looped BFS or interleaved 1F1B). A forward of micro-batch ``i`` on
    stage ``s`` starts when its device is free and stage ``s−1`` has finished (and sent) micro-batch
    ``i``; a backward starts when the device is free and stage ``s+1`` has finished the backward of
    ``i`` (on the last stage: its own forward of ``i``). A checkpointed micro-batch recomputes its
    forward right before its backward. See the module docstring for how the makespan compares with
    the plan's ``step_time``.

    Args:
        plan: the plan; its ``schedule`` (``gpipe``, ``1f1b``, ``zb``, ``zbv`` or
            ``dualpipev``), ``chunks``,
            ``virtual_stages`` and ``checkpoint`` set the order of operations, its stage
            times their lengths.

    Returns:
        Every event of the step, ordered by start time then stage. Zero-length transfers
        are left out. Stage ``s`` runs on device ``s mod K`` (``zbv``, ``dualpipev``: rank r
        runs stages r and 2K−1−r).

    Raises:
        ValueError: the plan's schedule is unknown, or its virtual stages do not divide
            its stages.
    """
    if plan.schedule not in ("gpipe", "1f1b", "zb", "zbv", "dualpipev"):
        raise ValueError(
            f"unknown schedule {plan.schedule!r}: choose gpipe, 1f1b, zb, zbv or dualpipev"
        )
    virtual = max(plan.virtual_stages, 1)
    if plan.num_stages % virtual:
        raise ValueError(f"{plan.num_stages} stages do not divide into {virtual} per device")
    times = stage_times(plan)
    last = plan.num_stages - 1
    ranks = _ranks(plan)
    # When each stage's forward output / backward gradient of micro-batch i is available.
    sent: dict[tuple[int, int], float] = {}
    grads: dict[tuple[int, int], float] = {}
    free = [0.0] * ranks
    events: list[Event] = []
    for op in replay_order(ranks, virtual, plan.chunks, plan.schedule):
        k, i, r, t = op.stage, op.micro_batch, op.rank, times[op.stage]
        hidden = _hidden(op, times)
        if op.forward:
            start = max(free[r], sent[(k - 1, i)] if k > 0 else 0.0)
            end = start + t.forward - hidden
            events.append(Event(k, i, "forward", start, end))
            if k < last and t.transfer > 0:
                events.append(Event(k, i, "transfer", end, end + t.transfer))
                end += t.transfer
            sent[(k, i)] = end
        elif op.kind == "W":  # the weights' gradients, when zero bubble gets to them
            end = free[r] + t.weight
            events.append(Event(k, i, "weight", free[r], end))
        else:
            start = max(free[r], sent[(k, i)] if k == last else grads[(k + 1, i)])
            if checkpointed(plan, i, k):
                events.append(Event(k, i, "recompute", start, start + t.forward))
                start += t.forward
            end = start + (t.backward if op.kind == "B" else t.backward - t.weight) - hidden
            events.append(Event(k, i, "backward", start, end))
            grads[(k, i)] = end
        free[r] = end
    events.sort(key=lambda e: (e.start, e.stage, KINDS.index(e.kind)))
    return events


def _hidden(op: Operation, times: Sequence[StageTimes]) -> float:
    """Seconds of ``op``'s all-to-alls its overlapped pair hides (0 outside a pair)."""
    if op.partner < 0:
        return 0.0
    f, b = (op.stage, op.partner) if op.forward else (op.partner, op.stage)
    tf, tb = times[f], times[b]
    share = float(hidden_share(tf.forward, tf.comm_forward, tb.backward, tb.comm_backward))
    return share * (times[op.stage].comm_forward if op.forward else times[op.stage].comm_backward)


def hidden_alltoalls(plan: Plan) -> list[float]:
    """Seconds of all-to-alls each rank's overlapped pairs hide in one step of ``plan``:
    all 0 but under ``dualpipev`` with expert parallelism."""
    ranks = _ranks(plan)
    if plan.schedule != "dualpipev":
        return [0.0] * ranks
    times = stage_times(plan)
    forward, backward, comm_forward, comm_backward = (
        np.array([[getattr(t, name) for t in times]])
        for name in ("forward", "backward", "comm_forward", "comm_backward")
    )
    hidden = hidden_seconds(
        forward, backward, comm_forward, comm_backward, ranks, plan.chunks, plan.schedule
    )
    return [float(x) for x in hidden[0]]


def makespan(events: Sequence[Event]) -> float:
    """Seconds from the first event's start to the last event's end (0 for none)."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)
