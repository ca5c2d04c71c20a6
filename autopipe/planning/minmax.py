"""Exact min-max contiguous partitioning ("chains on chains") with per-stage memory caps.

The bottleneck is found by bisection over a feasibility probe on prefix sums (Nicol 1994;
Pinar & Aykanat 2004). When every single layer fits every stage, the greedy probe is exact:
the ends reachable after k stages form an interval, so extending each stage as far as
possible loses nothing. When some layer fits only some stages, that interval property fails
and the probe becomes a reachability DP over all prefix ends, still O(K·L) per probe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.spans import prefix_sums, stage_spans
from autopipe.planning.tolerances import BISECT_MINMAX

__all__ = []

FloatArray = NDArray[np.float64]


def bottleneck(costs: Sequence[float] | FloatArray, balance: Sequence[int]) -> float:
    """The largest stage sum of ``costs`` under ``balance``."""
    values = np.asarray(costs, dtype=float)
    return max(float(values[a:b].sum()) for a, b in stage_spans(balance))


def _greedy(
    cost_prefix: FloatArray, mem_prefix: FloatArray, caps: FloatArray, limit: float
) -> list[int] | None:
    n = len(cost_prefix) - 1
    stages = len(caps)
    pos = 0
    ends = []
    for k in range(stages):
        remaining = stages - 1 - k
        by_cost = int(np.searchsorted(cost_prefix, cost_prefix[pos] + limit, side="right")) - 1
        by_mem = int(np.searchsorted(mem_prefix, mem_prefix[pos] + caps[k], side="right")) - 1
        end = min(by_cost, by_mem, n - remaining)
        if end <= pos:
            return None
        ends.append(end)
        pos = end
    if pos != n:
        return None
    return list(np.diff([0, *ends]).astype(int).tolist())


def _reachability(
    cost_prefix: FloatArray, mem_prefix: FloatArray, caps: FloatArray, limit: float
) -> list[int] | None:
    n = len(cost_prefix) - 1
    stages = len(caps)
    ends = np.arange(n + 1)
    # Smallest start s of a stage ending at e that respects the cost limit.
    lo_cost = np.searchsorted(cost_prefix, cost_prefix - limit, side="left")
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    lows = []
    history = []
    for k in range(stages):
        lo_mem = np.searchsorted(mem_prefix, mem_prefix - caps[k], side="left")
        lo = np.maximum(lo_cost, lo_mem)
        count = np.concatenate([[0], np.cumsum(reach)])
        # Some start in [lo(e), e) is reachable after k stages.
        nxt = (lo < ends) & (count[ends] - count[np.minimum(lo, ends)] > 0)
        history.append(reach)
        lows.append(lo)
        reach = nxt
    if not reach[n]:
        return None
    balance = []
    end = n
    for k in range(stages - 1, -1, -1):
        starts = np.flatnonzero(history[k][lows[k][end] : end]) + lows[k][end]
        start = int(starts[-1])
        balance.append(end - start)
        end = start
    return balance[::-1]


def _probe(
    costs: FloatArray,
    memory: FloatArray,
    caps: FloatArray,
    limit: float,
) -> list[int] | None:
    """A balance whose stage sums are all at most ``limit`` and fit ``caps``, or ``None``."""
    cost_prefix = prefix_sums(costs)
    mem_prefix = prefix_sums(memory)
    if float(memory.max(initial=0.0)) <= float(caps.min()):
        return _greedy(cost_prefix, mem_prefix, caps, limit)
    return _reachability(cost_prefix, mem_prefix, caps, limit)


def minmax_partition(
    costs: Sequence[float] | FloatArray,
    stages: int,
    memory: Sequence[float] | FloatArray | None = None,
    caps: Sequence[float] | FloatArray | None = None,
) -> list[int] | None:
    """The contiguous split into ``stages`` non-empty stages with the smallest bottleneck.

    Args:
        costs: non-negative cost per layer.
        stages: number of stages, at most ``len(costs)``.
        memory: non-negative memory per layer (default: none).
        caps: memory capacity per stage (default: unlimited).

    Returns:
        The balance (layers per stage), or ``None`` when no split fits the caps.
    """
    c = np.asarray(costs, dtype=float)
    n = len(c)
    m = np.zeros(n) if memory is None else np.asarray(memory, dtype=float)
    cap = np.full(stages, np.inf) if caps is None else np.asarray(caps, dtype=float)
    cost_prefix = prefix_sums(c)
    mem_prefix = prefix_sums(m)
    greedy_exact = float(m.max(initial=0.0)) <= float(cap.min())
    search = _greedy if greedy_exact else _reachability

    best = search(cost_prefix, mem_prefix, cap, np.inf)
    if best is None:
        return None
    hi = bottleneck(c, best)
    lo = max(float(c.max(initial=0.0)), float(cost_prefix[-1]) / stages)
    if lo >= hi:
        return best
    # The optimum is bracketed by (lo, hi]; hi is always the bottleneck of a real split.
    lower_bound = search(cost_prefix, mem_prefix, cap, lo)
    if lower_bound is not None:
        return lower_bound
    for _ in range(200):
        if hi - lo <= BISECT_MINMAX * hi:
            break
        mid = 0.5 * (lo + hi)
        found = search(cost_prefix, mem_prefix, cap, mid)
        if found is None:
            lo = mid
        else:
            best = found
            hi = bottleneck(c, found)
    return best
