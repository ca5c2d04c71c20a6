"""Virtual stages: K ranks each running v interleaved stages, their step time and memory.

With ``v`` virtual stages per rank a pipeline of K ranks is cut into K·v stages, and rank
r holds stages ``r, r+K, …, r+(v−1)·K`` (the looped placement of torch's interleaved
schedules). Each micro-batch visits every rank v times in smaller pieces, so the fill and
drain of the pipeline shrink v-fold while the messages grow v-fold (each stage's cost
``c_s`` includes its send). Per micro-batch rank r is busy ``C_r = Σ c_s`` over its stages,
and a step takes::

    T = M · max_r C_r + (Σ_s c_s − max_r C_r) / v

— for v = 1 GPipe's ``Σ c + (M−1)·max c``; for balanced stages ``(M + (K−1)/v) · C``, the
interleaved schedule's bubble of ``(K−1)/(v·M)`` (Narayanan et al. 2021).

Memory: rank r holds, for each of its stages, the activations of the micro-batches that
passed its forward and not yet its backward. ``gpipe`` runs as a looped breadth-first
schedule (every forward of the step before any backward): all M on every stage.
``1f1b`` runs as interleaved 1F1B, whose order :func:`in_flight` replays (warm-up
forwards in rounds of micro-batches, then one forward and one backward in turn).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["in_flight", "rank_of", "rank_stages", "rank_times", "step_time", "step_times"]


def rank_stages(rank: int, ranks: int, virtual: int) -> list[int]:
    """The stages rank ``rank`` of ``ranks`` holds: ``rank + j·ranks`` for j < ``virtual``."""
    return [rank + j * ranks for j in range(virtual)]


def rank_of(stage: int, ranks: int) -> int:
    """The rank that holds ``stage``."""
    return stage % ranks


def rank_times(times: Sequence[float], ranks: int) -> list[float]:
    """Each rank's busy seconds per micro-batch: the sum over its stages."""
    out = [0.0] * ranks
    for stage, time in enumerate(times):
        out[rank_of(stage, ranks)] += time
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
    """Predicted seconds of a step: ``M · max_r C_r + (Σ c − max_r C_r) / v``.

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


def in_flight(rank: int, ranks: int, virtual: int, chunks: int, schedule: str) -> list[int]:
    """The most micro-batches each stage of ``rank`` holds at once, in its stage order.

    ``gpipe`` (looped breadth-first): M on every stage. ``1f1b`` (interleaved): the order of
    torch's ``ScheduleInterleaved1F1B`` replayed: ``(v−1)·R + 2·(K−1−r)`` warm-up forwards
    (R micro-batches per round, at most M·v), then a forward and a backward in turn;
    forwards visit the local stages round by round in order, backwards in reverse.

    Raises:
        ValueError: an unknown schedule, or M not a multiple of the rounds' count.
    """
    if schedule == "gpipe":
        return [chunks] * virtual
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}")
    if virtual == 1:
        return [min(chunks, ranks - rank)]
    per_round = _rounds(ranks, chunks)
    if chunks % per_round:
        raise ValueError(f"interleaved 1f1b needs chunks a multiple of {per_round}")
    total = chunks * virtual
    warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), total)
    held = [0] * virtual
    peak = [0] * virtual
    forwards = backwards = 0

    def forward() -> None:
        nonlocal forwards
        local = (forwards // per_round) % virtual
        forwards += 1
        held[local] += 1
        peak[local] = max(peak[local], held[local])

    def backward() -> None:
        nonlocal backwards
        local = virtual - 1 - (backwards // per_round) % virtual
        backwards += 1
        held[local] -= 1

    for _ in range(warmup):
        forward()
    while forwards < total:
        forward()
        backward()
    while backwards < total:
        backward()
    return peak
