"""Exact minimization of the predicted step time ``Σ_k c_k + (M−1)·max_k c_k + max_k a_k``.

Dynamic programs over (stage, end layer) with one matrix of candidate stage costs per
distinct stage signature, O(K·L·W) per pass where W <= L is the most layers a stage can
hold within memory:

1. a min-max pass gives the smallest feasible bottleneck B*;
2. when ``Σ c_k`` is the same for every split (equal speeds, free transfers) the optimum is
   the min-max split; among those the pass minimizing ``Σ c_k²`` picks the most even one;
3. otherwise a branch and bound over the bottleneck bound B ≥ B* runs min-sum passes
   (smallest ``Σ c_k`` with every ``c_k <= B``) until no bound can beat the best step time.

With data parallelism the all-reduce term ``max_k a_k = α·max_k P_k`` depends on the split
too: :mod:`autopipe.planning.split.capsearch` minimizes it with a branch and bound over a cap on
every stage's parameters, each cap a mask on the stage matrices.

Tied parameters are exact in memory: a stage's matrix entry for ``[s, e)`` counts one copy
of each tied tensor it uses (:meth:`CostModel.state_memory`). The time to sum the copies'
gradients depends on how many stages hold each one, which no per-stage score carries: the
passes minimize the step without it, and the value returned adds it for the split found
(so a split that spreads a tied parameter over fewer stages, equal otherwise, may be
missed by at most that sum).

Cuts between the users of a tensor that must stay on one stage
(:mod:`autopipe.planning.model.cut_rules`) are no stage ends for the passes: every split they
compare is an allowed one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from autopipe import PlanningError
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.cut_rules import most_stages, refusal
from autopipe.planning.model.quantities import format_bytes
from autopipe.planning.model.spans import stage_bounds
from autopipe.planning.split.capsearch import minimize_over_caps, minimize_step
from autopipe.planning.split.tolerances import SAME_TIME

__all__ = ["gpipe_step_time"]

Array = NDArray[np.float64]
Score = Callable[[int], Array]


def gpipe_step_time(times: Array | list[float], chunks: int) -> float:
    """GPipe's step time from per-micro-batch stage costs: ``Σ c + (M−1)·max c``."""
    values = np.asarray(times, dtype=float)
    return float(values.sum() + (chunks - 1) * values.max())


def _band(model: CostModel) -> int:
    """The most layers any stage can hold within memory (at least 1).

    The least memory of a stage of d layers grows with d, so a bisection over d finds it.
    """
    n = model.num_layers
    width, seen = 1, set()
    # The last stages hold the fewest micro-batches (1F1B): the widest band comes first,
    # and a stage whose band cannot be wider is passed over after one look.
    for k in reversed(range(model.num_stages)):
        key = model.signature(k)
        if key in seen:
            continue
        seen.add(key)
        cap = model.capacity(k)
        if not np.isfinite(cap):
            return n

        def fits(d: int, k: int = k, cap: float = cap) -> bool:
            starts = np.arange(n - d + 1)
            return bool(np.any(model.stage_costs(k, starts, starts + d)[1] <= cap))

        if width < n and not fits(width + 1):
            continue
        lo, hi = width, n  # fits(lo) or lo == 1; find the largest d that fits
        if fits(hi):
            return n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        width = lo
    return width


class _Tables:
    """Per-stage (L+1)×W matrices indexed ``[end, length − 1]``, cached by signature.

    Stages longer than the band W of :func:`_band` cannot fit memory and are left out; the
    layout keeps the DP's minimum over starts on contiguous memory.
    """

    def __init__(self, model: CostModel, width: int | None = None) -> None:
        self.model = model
        n = model.num_layers
        self.width = _band(model) if width is None else width
        self.e = np.arange(n + 1)[:, None]
        self.s = self.e - np.arange(1, self.width + 1)[None, :]
        self.valid = self.s >= 0
        self.starts = np.maximum(self.s, 0)
        self._cache: dict[tuple[object, ...], tuple[Array, Array]] = {}
        self._params: Array | None = None

    def _build(self, k: int) -> tuple[Array, Array]:
        key = self.model.signature(k)
        if key not in self._cache:
            m, valid = self.model, self.valid
            e = np.broadcast_to(self.e, valid.shape)
            time = np.full(valid.shape, np.inf)
            over = np.full(valid.shape, np.inf)
            times, memory, _ = m.stage_costs(k, self.s[valid], e[valid])
            over[valid] = memory - m.capacity(k)
            time[valid] = np.where(over[valid] <= 0, times, np.inf)
            self._cache[key] = (time, over)
        return self._cache[key]

    def time(self, k: int) -> Array:
        """Stage cost for layers [s, e); ``inf`` where empty or over memory."""
        return self._build(k)[0]

    def overflow(self, k: int) -> Array:
        """Bytes over capacity for layers [s, e); ``inf`` where empty."""
        return self._build(k)[1]

    def params(self) -> Array:
        """Parameter bytes of layers [s, e); ``inf`` where empty."""
        if self._params is None:
            e = np.broadcast_to(self.e, self.valid.shape)
            bytes_ = self.model.param_bytes(self.starts, e)
            self._params = np.where(self.valid, bytes_, np.inf)
        return self._params


def _dp(tables: _Tables, score: Score, combine: str) -> tuple[float, list[int]] | None:
    """Min over splits of max (``combine='max'``) or sum of per-stage scores."""
    model = tables.model
    n, stages = model.num_layers, model.num_stages
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choices = []
    rows = np.arange(n + 1)
    for k in range(stages):
        matrix = score(k)
        previous = best[tables.starts]
        candidates = np.maximum(previous, matrix) if combine == "max" else previous + matrix
        # Leave at least one layer for each later stage.
        candidates[n - (stages - 1 - k) + 1 :, :] = np.inf
        if model.restricted and k < stages - 1:  # no stage ends where no cut may go
            candidates[model.forbidden, :] = np.inf
        arg = np.argmin(candidates, axis=1)
        best = candidates[rows, arg]
        choices.append(arg)
    if not np.isfinite(best[n]):
        return None
    balance = []
    end = n
    for k in range(stages - 1, -1, -1):
        length = int(choices[k][end]) + 1
        balance.append(length)
        end -= length
    return float(best[n]), balance[::-1]


def _bounds(balance: list[int]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    bounds = stage_bounds(balance)
    return bounds[:-1], bounds[1:]


def _stage_times(model: CostModel, balance: list[int]) -> Array:
    starts, ends = _bounds(balance)
    return np.array([float(model.stage_time(k, starts[k], ends[k])) for k in range(len(balance))])


def split_value(model: CostModel, balance: list[int]) -> float:
    """The predicted step time of ``balance``: pipeline, all-reduce and the sums of tied
    parameters' gradients, fits ignored."""
    starts, ends = _bounds(balance)
    allreduce = float(np.max(model.allreduce_time(starts, ends) + model.update_time(starts, ends)))
    pipeline = gpipe_step_time(_stage_times(model, balance), model.chunks)
    return pipeline + allreduce + model.tied_time(balance)


def _explain(model: CostModel) -> str:
    n = model.num_layers
    names = model.layers.names
    ks = range(model.num_stages)
    tables = _Tables(model, width=n)
    alone = np.array([[tables.overflow(k)[i + 1, 0] for k in ks] for i in range(n)])
    worst = alone.min(axis=1)
    i = int(np.argmax(worst))
    if worst[i] > 0:
        return (
            f"layer {i} ({names[i]}) does not fit on any device even alone: it needs "
            f"{format_bytes(worst[i])} more than the largest capacity; give the devices more "
            "memory, checkpoint, or use more micro-batches"
        )
    found = _dp(tables, tables.overflow, "max")
    assert found is not None
    _, balance = found
    bounds = stage_bounds(balance)
    over = [float(tables.overflow(k)[bounds[k + 1], balance[k] - 1]) for k in ks]
    k = int(np.argmax(over))
    first, last = names[bounds[k]], names[bounds[k + 1] - 1]
    return (
        f"no split into {model.num_stages} stages fits memory: even the best split {balance} "
        f"needs {format_bytes(over[k])} more on stage {k} (layers {first}..{last}); "
        "raise the memory limit, checkpoint, use more stages or more micro-batches"
    )


def _pipeline(tables: _Tables, time: Score) -> tuple[float, list[int]] | None:
    """The split minimizing ``Σ c + (M−1)·max c`` over stage costs ``time`` (inf: banned)."""
    model = tables.model
    found = _dp(tables, time, "max")
    if found is None:
        return None
    bound, balance = found
    chunks = model.chunks

    def bounded(limit: float, power: int = 1) -> Score:
        masked: dict[tuple[object, ...], Array] = {}

        def score(k: int) -> Array:
            key = model.signature(k)
            if key not in masked:
                matrix = time(k)
                masked[key] = np.where(matrix <= limit * (1 + SAME_TIME), matrix**power, np.inf)
            return masked[key]

        return score

    if model.sum_is_invariant():
        even = _dp(tables, bounded(bound, 2), "sum")
        best_balance = even[1] if even is not None else balance
        return gpipe_step_time(_stage_times(model, best_balance), chunks), best_balance

    def solve(limit: float) -> tuple[float, float, list[int]]:
        """Smallest Σ c_k with every c_k <= limit: (Σ, actual max, balance)."""
        result = _dp(tables, bounded(limit), "sum")
        assert result is not None  # limit >= the feasible min-max bottleneck
        times = _stage_times(model, result[1])
        return float(times.sum()), float(times.max()), result[1]

    return minimize_step(chunks, bound, solve)


def _with_allreduce(tables: _Tables, alpha: float, stop: float) -> tuple[float, list[int]]:
    """Minimizes ``F(A) + α·A`` over the cap A on stage parameters (see :mod:`capsearch`)."""
    model = tables.model
    params = tables.params()

    def solve(cap: float, limit: float) -> tuple[float, float, list[int]] | None:
        masked: dict[tuple[object, ...], Array] = {}

        def time(k: int) -> Array:
            key = model.signature(k)
            if key not in masked:
                masked[key] = np.where(params <= cap, tables.time(k), np.inf)
            return masked[key]

        found = _pipeline(tables, time)
        if found is None:
            return None
        starts, ends = _bounds(found[1])
        return found[0], float(np.max(model.param_bytes(starts, ends))), found[1]

    floor = max(
        float(model.param_bytes(np.array(0), np.array(model.num_layers))) / model.num_stages,
        float(np.max(model.layers.params)),
    )
    result = minimize_over_caps(solve, alpha, floor, stop=stop, max_solves=10_000)
    assert result is not None  # some split fits
    return result.bound, result.split


def solve_split(model: CostModel, stop: float = np.inf) -> tuple[float, list[int]] | None:
    """``(the least step time, its balance)``, or ``None`` when no split fits.

    Args:
        model: the cost model.
        stop: a step time beyond interest: a returned time at or above it may be a lower
            bound, and its balance merely one that fits.
    """
    if model.num_stages > model.num_layers:
        return None
    tables = _Tables(model)
    alpha = model.step_factor
    if alpha > 0 and model.num_stages > 1:
        if _dp(tables, tables.time, "max") is None:
            return None
        bound, split = _with_allreduce(tables, alpha, stop)
        # At or above ``stop`` the bound may be a lower bound: the tied sums' least is 0.
        return (bound + model.tied_time(split) if bound < stop else bound), split
    found = _pipeline(tables, tables.time)
    if found is None:
        return None
    return split_value(model, found[1]), found[1]


def check_cuts(model: CostModel) -> None:
    """Refuses a request where every split cuts between the users of an ``unsplit`` tensor.

    Raises:
        PlanningError: no split into the model's stages is allowed; the message names the
            tensors, their users and the most stages allowed.
    """
    if model.restricted and model.num_stages > most_stages(model.forbidden):
        layers = model.layers
        raise PlanningError(refusal(layers.tied, layers.names, model.num_stages, model.forbidden))


def memory_split(model: CostModel) -> list[int]:
    """The split whose largest stage needs the least memory, every stage fitting.

    For stages that all share one device (:mod:`autopipe.planning.model.colocation`) every
    split takes the same time, so memory is what tells them apart.

    Raises:
        PlanningError: no split fits; the message names the layer or stage and the bytes
            missing.
    """
    check_cuts(model)
    tables = _Tables(model)
    e = np.broadcast_to(tables.e, tables.valid.shape)
    valid = tables.valid

    def memory(k: int) -> Array:
        matrix = np.full(valid.shape, np.inf)
        matrix[valid] = model.stage_memory(k, tables.s[valid], e[valid])
        return np.where(tables.overflow(k) <= 0, matrix, np.inf)

    found = _dp(tables, memory, "max")
    if found is None:
        raise PlanningError(_explain(model))
    return found[1]


def optimal_split(model: CostModel) -> list[int]:
    """The balance minimizing the predicted step time under every stage's memory cap.

    Raises:
        PlanningError: no split fits; the message names the layer or stage and the bytes
            missing.
    """
    if model.num_stages > model.num_layers:
        raise PlanningError(
            f"cannot split {model.num_layers} layers into {model.num_stages} non-empty stages"
        )
    check_cuts(model)
    found = solve_split(model)
    if found is None:
        raise PlanningError(_explain(model))
    return found[1]
