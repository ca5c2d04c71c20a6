"""Exact minimization of the predicted step time ``Σ_k c_k + (M−1)·max_k c_k``.

Dynamic programs over (stage, end layer) with one matrix of candidate stage costs per
distinct stage signature, O(K·L²) per pass:

1. a min-max pass gives the smallest feasible bottleneck B*;
2. when ``Σ c_k`` is the same for every split (equal speeds, free transfers) the optimum is
   the min-max split; among those the pass minimizing ``Σ c_k²`` picks the most even one;
3. otherwise a branch and bound over the bottleneck bound B ≥ B* runs min-sum passes
   (smallest ``Σ c_k`` with every ``c_k <= B``) until no bound can beat the best step time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from autopipe.cost_model import CostModel
from autopipe.errors import PlanningError
from autopipe.units import format_bytes

__all__ = ["optimal_split", "step_time"]

Array = NDArray[np.float64]
_RTOL = 1e-9


def step_time(times: Array | list[float], chunks: int) -> float:
    """GPipe's step time from per-micro-batch stage costs: ``Σ c + (M−1)·max c``."""
    values = np.asarray(times, dtype=float)
    return float(values.sum() + (chunks - 1) * values.max())


class _Tables:
    """Per-stage (L+1)×(L+1) matrices indexed ``[end, start]``, cached by signature.

    End-major layout keeps the DP's minimum over starts on contiguous memory.
    """

    def __init__(self, model: CostModel) -> None:
        self.model = model
        n = model.num_layers
        self.e = np.arange(n + 1)[:, None]
        self.s = np.arange(n + 1)[None, :]
        self._cache: dict[tuple[object, tuple[object, ...]], Array] = {}

    def _get(self, kind: str, k: int, build: Callable[[], Array]) -> Array:
        key = (kind, self.model.signature(k))
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def time(self, k: int) -> Array:
        """Stage cost for layers [s, e); ``inf`` where empty or over memory."""

        def build() -> Array:
            m = self.model
            valid = self.s < self.e
            s, e = np.broadcast_arrays(self.s, self.e)
            out = np.full(valid.shape, np.inf)
            ss, ee = s[valid], e[valid]
            times = m.stage_time(k, ss, ee)
            fits = m.stage_memory(k, ss, ee) <= m.capacity(k)
            out[valid] = np.where(fits, times, np.inf)
            return out

        return self._get("time", k, build)

    def overflow(self, k: int) -> Array:
        """Bytes over capacity for layers [s, e); ``inf`` where empty."""

        def build() -> Array:
            m = self.model
            valid = self.s < self.e
            s, e = np.broadcast_arrays(self.s, self.e)
            out = np.full(valid.shape, np.inf)
            out[valid] = m.stage_memory(k, s[valid], e[valid]) - m.capacity(k)
            return out

        return self._get("overflow", k, build)


def _dp(
    tables: _Tables, score: Callable[[int], Array], combine: str
) -> tuple[float, list[int]] | None:
    """Min over splits of max (``combine='max'``) or sum of per-stage scores."""
    model = tables.model
    n, stages = model.num_layers, model.num_stages
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choices = []
    for k in range(stages):
        matrix = score(k)
        if combine == "max":
            candidates = np.maximum(best[None, :], matrix)
        else:
            candidates = best[None, :] + matrix
        # Leave at least one layer for each later stage.
        candidates[n - (stages - 1 - k) + 1 :, :] = np.inf
        arg = np.argmin(candidates, axis=1)
        best = candidates[np.arange(n + 1), arg]
        choices.append(arg)
    if not np.isfinite(best[n]):
        return None
    balance = []
    end = n
    for k in range(stages - 1, -1, -1):
        start = int(choices[k][end])
        balance.append(end - start)
        end = start
    return float(best[n]), balance[::-1]


def _stage_times(model: CostModel, balance: list[int]) -> Array:
    bounds = np.cumsum([0, *balance])
    return np.array(
        [
            float(model.stage_time(k, np.array(bounds[k]), np.array(bounds[k + 1])))
            for k in range(len(balance))
        ]
    )


def _explain(model: CostModel, tables: _Tables) -> str:
    n = model.num_layers
    names = model.layers.names
    ks = range(model.num_stages)
    alone = np.array([[tables.overflow(k)[i + 1, i] for k in ks] for i in range(n)])
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
    bounds = np.cumsum([0, *balance])
    over = [float(tables.overflow(k)[bounds[k + 1], bounds[k]]) for k in ks]
    k = int(np.argmax(over))
    first, last = names[bounds[k]], names[bounds[k + 1] - 1]
    return (
        f"no split into {model.num_stages} stages fits memory: even the best split {balance} "
        f"needs {format_bytes(over[k])} more on stage {k} (layers {first}..{last}); "
        "raise the memory limit, checkpoint, use more stages or more micro-batches"
    )


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
    tables = _Tables(model)
    found = _dp(tables, tables.time, "max")
    if found is None:
        raise PlanningError(_explain(model, tables))
    bound, balance = found
    chunks = model.chunks

    def bounded(limit: float, power: int = 1) -> Callable[[int], Array]:
        masked: dict[tuple[object, ...], Array] = {}

        def score(k: int) -> Array:
            key = model.signature(k)
            if key not in masked:
                matrix = tables.time(k)
                masked[key] = np.where(matrix <= limit * (1 + _RTOL), matrix**power, np.inf)
            return masked[key]

        return score

    if model.sum_is_invariant():
        even = _dp(tables, bounded(bound, 2), "sum")
        return even[1] if even is not None else balance

    best_time, best_balance = np.inf, balance

    def solve(limit: float) -> tuple[float, float, list[int]]:
        """Smallest Σ c_k with every c_k <= limit: (Σ, actual max, balance)."""
        result = _dp(tables, bounded(limit), "sum")
        assert result is not None  # limit >= the feasible min-max bottleneck
        times = _stage_times(model, result[1])
        nonlocal best_time, best_balance
        value = step_time(times, chunks)
        if value < best_time:
            best_time, best_balance = value, result[1]
        return float(times.sum()), float(times.max()), result[1]

    floor_sum, _, _ = solve(np.inf)
    if chunks == 1:
        return best_balance
    lo_sum, _, _ = solve(bound)
    # F(B) = (M−1)·B + S(B) with S non-increasing: bounds past this cannot win.
    ceiling = max(bound, (best_time - floor_sum) / (chunks - 1))
    hi_sum, _, _ = solve(ceiling)
    # Each interval (lo, hi] carries S(lo) and S(hi); a split whose bottleneck lies inside
    # costs more than (M−1)·lo + S(hi).
    stack = [(bound, lo_sum, ceiling, hi_sum)]
    while stack:
        lo, lo_sum, hi, hi_sum = stack.pop()
        if hi - lo <= _RTOL * hi or hi_sum >= lo_sum * (1 - _RTOL):
            continue
        if (chunks - 1) * lo + hi_sum >= best_time * (1 - _RTOL):
            continue
        mid = 0.5 * (lo + hi)
        mid_sum, mid_peak, _ = solve(mid)
        # S is constant on [mid_peak, mid], where the split just found is the best. (The
        # peak can exceed mid by the comparison slack; clamping keeps intervals shrinking.)
        stack.append((lo, lo_sum, min(mid_peak, mid), mid_sum))
        stack.append((mid, mid_sum, hi, hi_sum))
    return best_balance
