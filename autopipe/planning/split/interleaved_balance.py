"""The split of K·v virtual stages that an interleaved schedule runs fastest.

With v > 1 stages per rank the step time is that of the schedule's own order of operations
replayed with the stages' times (:mod:`autopipe.planning.schedules.schedule_replay`): it depends on
each rank's sum over its stages and on how the stages' times line up along that order, so the
exact min-max balance of the K·v stages (:func:`autopipe.planning.split.exact.optimal_split`) is a
good start but not the answer: a rank may collect two heavy stages. :func:`interleaved_split`
evaluates every split at once when there are at most :data:`EXHAUSTIVE` of them (exact),
and otherwise starts from the exact K·v-stage split and the uniform one and moves single
cut points, the best move of all at each turn, while the step time (with every stage and
every rank within memory) improves (a local search). A split that cuts where no cut may go
(:mod:`autopipe.planning.model.cut_rules`) counts as one that does not fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.spans import fits_memory, stage_bounds
from autopipe.planning.schedules.schedule_replay import makespans
from autopipe.planning.split.tolerances import IMPROVEMENT

__all__: list[str] = []

# Splits evaluated exhaustively (vectorized) before falling back to the local search.
EXHAUSTIVE = 200_000


def _replayed(
    model: CostModel, bounds: NDArray[np.int64], memory_limits: bool = True
) -> NDArray[np.float64]:
    """Replayed step time of every row of stage bounds (rows: splits); with
    ``memory_limits``, ``inf`` for splits that do not fit (a stage, or a rank's stages
    together, over the device's memory)."""
    stages = model.num_stages
    shape = (len(bounds), stages)
    forward, backward, transfer = np.empty(shape), np.empty(shape), np.empty(shape)
    codes = np.empty(shape, dtype=np.int64)
    memory = np.empty(shape)
    saved = np.empty(shape)
    weight = np.empty(shape)
    held = np.empty((*shape, 3))
    comm = (np.zeros(shape), np.zeros(shape))  # dualpipev's all-to-alls, which pairs hide
    for k in range(stages):
        s, e = bounds[:, k], bounds[:, k + 1]
        parts = model.stage_parts(k, s, e)
        forward[:, k], backward[:, k], transfer[:, k] = (
            parts.forward,
            parts.backward,
            parts.transfer,
        )
        codes[:, k], memory[:, k] = parts.recompute, parts.memory
        saved[:, k] = parts.memory - model.held_state(s, e)  # as model.saved_memory
        weight[:, k], held[:, k] = parts.weight, parts.held
        comm[0][:, k], comm[1][:, k] = parts.comm_forward, parts.comm_backward
    ranks = model.num_ranks
    if memory_limits:
        fits = fits_memory(model, memory, saved, held)
    else:
        fits = np.ones(len(bounds), dtype=bool)
    if memory_limits and model.restricted:  # and no cut where none may go
        fits &= ~model.forbidden[bounds[:, 1:-1]].any(axis=1)
    times = np.full(len(bounds), np.inf)
    if fits.any():
        times[fits] = makespans(
            forward[fits],
            backward[fits],
            transfer[fits],
            codes[fits],
            ranks,
            model.chunks,
            model.schedule,
            weight[fits],
            (comm[0][fits], comm[1][fits]) if model.overlapped else None,
        )
    return times


def pipeline_time(model: CostModel, balance: Sequence[int]) -> float:
    """The replayed interleaved pipeline time of ``balance``, whether or not it fits."""
    return float(_replayed(model, stage_bounds(balance)[None, :], memory_limits=False)[0])


def _interleaved_cost(model: CostModel, balance: Sequence[int]) -> float | None:
    """Predicted pipeline time of ``balance`` under ``model``'s interleaving; ``None`` if
    it does not fit (a stage over its device, or a rank's stages together over it)."""
    cost = float(_replayed(model, stage_bounds(balance)[None, :])[0])
    return cost if np.isfinite(cost) else None


def _moves(balance: list[int]) -> Iterable[list[int]]:
    """Every balance one cut point away, by 1, 2, 4, ... layers, stages kept non-empty."""
    for cut in range(len(balance) - 1):
        step = 1
        while step < sum(balance):
            for delta in (step, -step):
                moved = list(balance)
                moved[cut] += delta
                moved[cut + 1] -= delta
                if moved[cut] >= 1 and moved[cut + 1] >= 1:
                    yield moved
            step *= 2


def every_split(layers: int, stages: int) -> NDArray[np.int64]:
    """The stage bounds ``[0, c_1, …, layers]`` of every split into non-empty stages, one
    row each (``C(layers − 1, stages − 1)`` rows)."""
    found = list(itertools.combinations(range(1, layers), stages - 1))
    # Shaped by the row count: one stage has one split with no cut (a reshape to (-1, 0)
    # of the empty array could not tell how many rows).
    cuts = np.array(found, dtype=np.int64).reshape(len(found), stages - 1)
    ends = np.full((len(cuts), 1), layers, dtype=np.int64)
    return np.concatenate([np.zeros_like(ends), cuts, ends], axis=1)


def _exhaustive_split(model: CostModel) -> tuple[list[int], float] | None:
    """The split with the least interleaved step time among all that fit, and that time,
    by evaluating every one (``None``: none fits). Only for at most :data:`EXHAUSTIVE`
    splits."""
    bounds = every_split(model.num_layers, model.num_stages)
    cost = _replayed(model, bounds)
    if not np.isfinite(cost).any():
        return None
    best = int(np.argmin(cost))
    return [int(b) for b in np.diff(bounds[best])], float(cost[best])


def interleaved_split(model: CostModel, starts: Sequence[Sequence[int]]) -> list[int] | None:
    """The split of the least interleaved step time: every split when there are at most
    :data:`EXHAUSTIVE`, else the best found from ``starts`` by moving one cut point at a
    time.

    Returns:
        The balance with the smallest :func:`_interleaved_cost`, or ``None`` when none that
        was tried fits.
    """
    found = timed_split(model, starts)
    return None if found is None else found[0]


def timed_split(
    model: CostModel, starts: Sequence[Sequence[int]]
) -> tuple[list[int], float] | None:
    """:func:`interleaved_split` and the split's :func:`pipeline_time`, which its search
    computed (a caller need not replay it again)."""
    if math.comb(model.num_layers - 1, model.num_stages - 1) <= EXHAUSTIVE:
        return _exhaustive_split(model)
    best: list[int] | None = None
    best_cost = float("inf")
    for start in starts:
        current, cost = list(start), _interleaved_cost(model, start)
        if cost is None:
            cost = float("inf")
        while True:
            # Every move from here at once; take the best while it improves.
            moves = list(_moves(current))
            if not moves:
                break
            found = _replayed(model, np.array([stage_bounds(m) for m in moves]))
            pick = int(np.argmin(found))
            if not found[pick] < cost * (1 - IMPROVEMENT):
                break
            current, cost = moves[pick], float(found[pick])
        if cost < best_cost:
            best, best_cost = current, cost
    return None if best is None else (best, best_cost)
