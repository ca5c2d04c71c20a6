"""Exact min-max contiguous partitioning ("chains on chains") with per-stage memory caps.

The bottleneck is found by bisection over a feasibility probe on prefix sums (Nicol 1994;
Pinar & Aykanat 2004). When every single layer fits every stage, the greedy probe is exact:
the ends reachable after k stages form an interval, so extending each stage as far as
possible loses nothing. When some layer fits only some stages, that interval property fails
and the probe becomes a reachability DP over all prefix ends, still O(K·L) per probe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.spans import prefix_sums, stage_bounds, stage_spans
from autopipe.planning.split.tolerances import BISECT_MINMAX

__all__ = []

FloatArray = NDArray[np.float64]


def bottleneck(costs: Sequence[float] | FloatArray, balance: Sequence[int]) -> float:
    """The largest stage sum of ``costs`` under ``balance``."""
    values = np.asarray(costs, dtype=float)
    return max(float(values[a:b].sum()) for a, b in stage_spans(balance))


def _peak(cost_prefix: FloatArray, balance: Sequence[int]) -> float:
    """The largest stage sum of ``balance``, read off the prefix sums the probes compare."""
    return float(np.max(np.diff(cost_prefix[stage_bounds(balance)])))


def _greedy(
    cost_prefix: FloatArray, mem_prefix: FloatArray | None, caps: FloatArray, limit: float
) -> list[int] | None:
    n = len(cost_prefix) - 1
    stages = len(caps)
    # The loop runs K times a probe and tens of probes a split: the arrays' own methods
    # and Python numbers keep numpy's per-call wrappers from outweighing the searches.
    by_cost = cost_prefix.searchsorted
    by_mem = None if mem_prefix is None else mem_prefix.searchsorted
    room = caps.tolist()
    pos = 0
    ends = []
    for k in range(stages):
        end = min(int(by_cost(cost_prefix[pos] + limit, side="right")) - 1, n - stages + 1 + k)
        if by_mem is not None:
            assert mem_prefix is not None
            end = min(end, int(by_mem(mem_prefix[pos] + room[k], side="right")) - 1)
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
    cap = np.full(stages, np.inf) if caps is None else np.asarray(caps, dtype=float)
    cost_prefix = prefix_sums(c)
    # Without a finite cap memory cannot bind: its prefix sums (as long as the costs') and
    # their searches are left out.
    mem_prefix = None
    search: Callable[..., list[int] | None] = _greedy
    if np.any(np.isfinite(cap)):
        m = np.zeros(n) if memory is None else np.asarray(memory, dtype=float)
        mem_prefix = prefix_sums(m)
        if float(m.max(initial=0.0)) > float(cap.min()):
            search = _reachability

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
    # Without memory caps a split within one layer of the average exists (close each stage
    # at the first layer past it): probing there first narrows (lo, hi] from about the
    # whole sum to the largest layer, a dozen fewer probes at 10⁶ layers. The probe is
    # exact, so a miss raises lo as soundly.
    near = lo + float(c.max(initial=0.0))
    if near < hi:
        found = search(cost_prefix, mem_prefix, cap, near)
        if found is None:
            lo = near
        else:
            best, hi = found, _peak(cost_prefix, found)
    for _ in range(200):
        if hi - lo <= BISECT_MINMAX * hi:
            break
        mid = 0.5 * (lo + hi)
        found = search(cost_prefix, mem_prefix, cap, mid)
        if found is None:
            lo = mid
        else:
            best = found
            hi = _peak(cost_prefix, found)
    return best
