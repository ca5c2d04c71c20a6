"""Virtual stages: K ranks each running v interleaved stages, their order, time and memory.

With ``v`` virtual stages per rank a pipeline of K ranks is cut into K·v stages, and rank
r holds stages ``r, r+K, …, r+(v−1)·K`` (the looped placement of torch's interleaved
schedules). Each micro-batch visits every rank v times in smaller pieces, so the fill and
drain of the pipeline shrink v-fold while the messages grow v-fold (each stage's cost
``c_s`` includes its send). :func:`rank_order` gives the operations each rank runs, in
torch's order: ``gpipe`` runs as a looped breadth-first schedule (every forward of the
step before any backward), ``1f1b`` as interleaved 1F1B (warm-up forwards in rounds of
micro-batches, then one forward and one backward in turn).

The planner replays those orders with the stages' times
(:mod:`autopipe.planning.schedules.schedule_replay`). For balanced stages and ``M ≥ K`` the replay
is the closed form :func:`step_time`, with ``C_r = Σ c_s`` over rank r's stages::

    T = M · max_r C_r + (Σ_s c_s − max_r C_r) / v

— for v = 1 GPipe's ``Σ c + (M−1)·max c``; for balanced stages ``(M + (K−1)/v) · C``, the
interleaved schedule's bubble of ``(K−1)/(v·M)`` (Narayanan et al. 2021). With unbalanced
stages, or fewer micro-batches than ranks, the replay is longer: a heavy stage holds up the
stages after it on other ranks, which the rank sums do not see.

Memory: rank r holds, for each of its stages, the activations of the micro-batches that
passed its forward and not yet its backward (:func:`in_flight`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.schedules.v_schedules import v_order, v_rank, v_stages

__all__ = ["rank_order", "rank_stages", "spared", "stage_placement"]

# The schedules that place two stages per rank in a V (rank r: stages r and 2K−1−r).
V_PLACED = ("zbv", "dualpipev")


def rank_stages(rank: int, ranks: int, virtual: int, schedule: str = "1f1b") -> list[int]:
    """The stages rank ``rank`` of ``ranks`` holds, in its local order: ``rank + j·ranks``
    for j < ``virtual`` (looped), or ``[r, 2K−1−r]`` under a V schedule."""
    if schedule in V_PLACED:
        return v_stages(rank, ranks)
    return [rank + j * ranks for j in range(virtual)]


def stage_rank(stage: int, ranks: int, schedule: str = "1f1b") -> int:
    """The rank that holds ``stage``: ``stage mod K``, or its V placement's rank."""
    return v_rank(stage, ranks) if schedule in V_PLACED else stage % ranks


def stage_placement(stages: int, ranks: int, schedule: str = "1f1b") -> list[int]:
    """Each of ``stages`` stages' rank, in stage order."""
    return [stage_rank(s, ranks, schedule) for s in range(stages)]


def _rank_of(stage: int, ranks: int) -> int:
    """The rank that holds ``stage``."""
    return stage % ranks


def rank_times(times: Sequence[float], ranks: int) -> list[float]:
    """Each rank's busy seconds per micro-batch: the sum over its stages."""
    out = [0.0] * ranks
    for stage, time in enumerate(times):
        out[_rank_of(stage, ranks)] += time
    return out


def step_times(times: NDArray[np.float64], ranks: int, chunks: int) -> NDArray[np.float64]:
    """:func:`step_time` of every row of ``times`` (rows: splits; columns: the K·v stages).

    Raises:
        ValueError: the stages do not divide among the ranks.
    """
    stages = times.shape[-1]
    if ranks < 1 or not stages or stages % ranks:
        raise ValueError(f"{stages} stages do not divide among {ranks} ranks")
    busiest = np.max([times[..., r::ranks].sum(axis=-1) for r in range(ranks)], axis=0)
    return chunks * busiest + (times.sum(axis=-1) - busiest) / (stages // ranks)


def step_time(times: Sequence[float], ranks: int, chunks: int) -> float:
    """The closed-form step: ``M · max_r C_r + (Σ c − max_r C_r) / v``.

    Exact for balanced stages with at least as many micro-batches as ranks; otherwise an
    estimate of the replayed step (:func:`autopipe.planning.schedules.schedule_replay.makespans`),
    often too low.

    Args:
        times: per-micro-batch cost of each of the K·v stages, in pipeline order.
        ranks: K, the ranks of the pipeline.
        chunks: M, micro-batches per step.

    Raises:
        ValueError: the stages do not divide among the ranks.
    """
    return float(step_times(np.array([times], dtype=float), ranks, chunks)[0])


def _rounds(ranks: int, chunks: int) -> int:
    """Micro-batches per round of interleaved 1F1B: ``M / max(1, M // K)``."""
    return chunks // max(1, chunks // ranks)


# One operation of a rank: ("F" or "B", stage, micro-batch).
Action = tuple[str, int, int]


def _one_stage_order(rank: int, ranks: int, chunks: int, schedule: str) -> list[Action]:
    if schedule == "1f1b":
        # Warm-up fills the pipeline below this stage; then one forward, one backward.
        warmup = min(ranks - rank - 1, chunks)
        order = [("F", rank, i) for i in range(warmup)]
        for j in range(chunks - warmup):
            order += [("F", rank, warmup + j), ("B", rank, j)]
        return order + [("B", rank, i) for i in range(chunks - warmup, chunks)]
    # GPipe: all forwards, then backwards in reverse (autograd's order).
    return [("F", rank, i) for i in range(chunks)] + [
        ("B", rank, i) for i in reversed(range(chunks))
    ]


def _interleaved_order(rank: int, ranks: int, virtual: int, chunks: int) -> list[Action]:
    """Torch's ScheduleInterleaved1F1B order for one rank (its no-op slots left out)."""
    per_round = _rounds(ranks, chunks)
    if chunks % per_round:
        raise ValueError(f"interleaved 1f1b needs chunks a multiple of {per_round}")
    total = chunks * virtual
    warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), total)
    # Each stage takes its micro-batches in order, forwards and backwards alike.
    next_forward = [0] * virtual
    next_backward = [0] * virtual
    order: list[Action] = []

    def forward(step: int) -> None:
        local = (step // per_round) % virtual
        order.append(("F", rank + local * ranks, next_forward[local]))
        next_forward[local] += 1

    def backward(step: int) -> None:
        local = virtual - 1 - (step // per_round) % virtual
        order.append(("B", rank + local * ranks, next_backward[local]))
        next_backward[local] += 1

    for step in range(warmup):
        forward(step)
    for step in range(warmup, total):
        forward(step)
        backward(step - warmup)
    for step in range(total - warmup, total):
        backward(step)
    return order


def _zero_bubble_order(rank: int, ranks: int, virtual: int, chunks: int) -> list[Action]:
    """Torch's ScheduleInterleavedZeroBubble order for one rank (no-op slots left out).

    Each backward is split in two: ``"I"`` computes the input's gradient (and sends it on),
    ``"W"`` the weights' gradients, deferred to fill the pipeline's idle time.
    """
    per_round = _rounds(ranks, chunks)
    if chunks % per_round:
        raise ValueError(f"zero bubble needs chunks a multiple of {per_round}")
    total = chunks * virtual
    warmup = min((virtual - 1) * per_round + (ranks - 1 - rank), total)
    counters = {op: [0] * virtual for op in "FIW"}
    order: list[Action] = []

    def add(op: str, local: int) -> None:
        order.append((op, rank + local * ranks, counters[op][local]))
        counters[op][local] += 1

    def forward(step: int) -> None:
        add("F", (step // per_round) % virtual)

    def backward_local(step: int) -> int:
        return virtual - 1 - ((step - warmup) // per_round) % virtual

    backwards: list[int] = []
    weights = 0
    for step in range(total + warmup):
        if step < warmup:
            forward(step)
            continue
        if step < total:
            forward(step)
        add("I", backward_local(step))
        backwards.append(step)
        if step - warmup >= rank:  # the first ``rank`` weight passes wait for idle time
            add("W", backward_local(backwards[weights]))
            weights += 1
    for step in backwards[weights:]:
        add("W", backward_local(step))
    return order


def rank_order(rank: int, ranks: int, virtual: int, chunks: int, schedule: str) -> list[Action]:
    """The operations rank ``rank`` runs in one step, in order: ``(op, stage, micro-batch)``.

    ``op`` is ``"F"`` (forward) or ``"B"`` (backward), or under ``zb`` (torch's
    ``ScheduleInterleavedZeroBubble``, any v) ``"I"`` and ``"W"``: the backward split into
    the input's gradient and the weights', which waits for idle time; ``zbv`` and
    ``dualpipev`` (v = 2, V placement) as :func:`~autopipe.planning.schedules.v_schedules.v_order`
    (``"B"`` there: a whole backward). One stage per rank: GPipe's
    fill–drain (backwards in reverse, as autograd runs them) or 1F1B (``K−1−r`` warm-up
    forwards, then a forward and a backward in turn). Virtual stages: ``gpipe`` is torch's
    ``ScheduleLoopedBFS`` (every forward of each local stage in turn, then the backwards
    in reverse) and ``1f1b`` torch's ``ScheduleInterleaved1F1B``: ``(v−1)·R + 2·(K−1−r)``
    warm-up forwards (R micro-batches per round, at most M·v), then a forward and a
    backward in turn; forwards visit the local stages round by round in order, backwards
    in reverse.

    Raises:
        ValueError: an unknown schedule, or interleaved 1F1B with M not a multiple of the
            rounds' count.
    """
    if schedule in V_PLACED:
        if virtual != 2:
            raise ValueError(f"{schedule} runs 2 stages per rank, not {virtual}")
        return v_order(rank, ranks, chunks, schedule)
    if schedule not in ("gpipe", "1f1b", "zb"):
        raise ValueError(f"unknown schedule {schedule!r}")
    if schedule == "zb":
        return _zero_bubble_order(rank, ranks, virtual, chunks)
    if virtual == 1:
        return _one_stage_order(rank, ranks, chunks, schedule)
    if schedule == "1f1b":
        return _interleaved_order(rank, ranks, virtual, chunks)
    stages = rank_stages(rank, ranks, virtual)
    forwards = [("F", s, i) for s in stages for i in range(chunks)]
    return forwards + [("B", s, i) for s in reversed(stages) for i in reversed(range(chunks))]


@functools.lru_cache(maxsize=256)
def spared(ranks: int, virtual: int, chunks: int, schedule: str) -> tuple[int, ...]:
    """Per stage, the micro-batch whose backward it runs first.

    ``except_last`` checkpointing spares it: its activations are needed right after its
    forward's turn ends, so re-computing them saves nothing. The single-process GPipe order
    (and looped BFS) runs backwards in reverse, so that is the last micro-batch; torch's
    1F1B, interleaved 1F1B and the distributed GPipe run them in order: the first.

    Raises:
        ValueError: as :func:`rank_order`.
    """
    first: dict[int, int] = {}
    for rank in range(ranks):
        for op, stage, micro_batch in rank_order(rank, ranks, virtual, chunks, schedule):
            if op in ("B", "I"):
                first.setdefault(stage, micro_batch)
    return tuple(first[stage] for stage in range(ranks * virtual))


def in_flight(rank: int, ranks: int, virtual: int, chunks: int, schedule: str) -> list[int]:
    """The most micro-batches each stage of ``rank`` holds at once, in its stage order.

    Replays :func:`rank_order`: a stage holds a micro-batch from its forward to its
    backward. ``gpipe``: M on every stage; ``1f1b`` with one stage per rank:
    ``min(M, K − r)``.

    Raises:
        ValueError: as :func:`rank_order`.
    """
    return list(_in_flight(rank, ranks, virtual, chunks, schedule))


# A search builds a cost model per configuration, each replaying every rank's order: the
# replays depend on (K, v, M, schedule) alone, and many configurations share them.
@functools.lru_cache(maxsize=4096)
def _in_flight(rank: int, ranks: int, virtual: int, chunks: int, schedule: str) -> tuple[int, ...]:
    held = [0] * virtual
    peak = [0] * virtual
    local_of = {s: j for j, s in enumerate(rank_stages(rank, ranks, virtual, schedule))}
    for op, stage, _ in rank_order(rank, ranks, virtual, chunks, schedule):
        local = local_of[stage]
        # A stage holds a micro-batch's activations until its weights' gradients are done.
        # (A whole backward, ``"B"``, frees it at once.)
        held[local] += {"F": 1, "B": -1, "W": -1}.get(op, 0)
        peak[local] = max(peak[local], held[local])
    return tuple(peak)


@functools.lru_cache(maxsize=4096)
def held_shares(
    rank: int, ranks: int, virtual: int, chunks: int, schedule: str
) -> NDArray[np.float64]:
    """What share of each of its stages' peak activations ``rank`` holds at once.

    Rows: the moments just after a forward of the replayed order (only a forward adds
    activations), with the rows that another row bounds in every column dropped; columns:
    the rank's stages in :func:`rank_stages` order, each its held micro-batches over its
    own peak (:func:`in_flight`). A rank's activations at its peak are the largest
    ``row · a`` for its stages' peak activations ``a``: its stages do not all peak at the
    same moment (under interleaved 1F1B the first local stage peaks after the warm-up,
    when the last has already freed most of its own), so the sum of their peaks
    overstates what the device holds.

    Raises:
        ValueError: as :func:`rank_order`.
    """
    peak = in_flight(rank, ranks, virtual, chunks, schedule)
    local_of = {s: j for j, s in enumerate(rank_stages(rank, ranks, virtual, schedule))}
    held = [0] * virtual
    moments: set[tuple[int, ...]] = set()
    for op, stage, _ in rank_order(rank, ranks, virtual, chunks, schedule):
        local = local_of[stage]
        held[local] += {"F": 1, "B": -1, "W": -1}.get(op, 0)
        if op == "F":
            moments.add(tuple(held))
    rows = sorted(moments, reverse=True)
    kept: list[tuple[int, ...]] = []
    for row in rows:  # a row bounded by a kept one in every column never sets the peak
        if not any(all(a >= b for a, b in zip(other, row, strict=True)) for other in kept):
            kept.append(row)
    shares = np.array(kept, dtype=np.float64)
    return shares / np.maximum(np.array(peak, dtype=np.float64), 1.0)
