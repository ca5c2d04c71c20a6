"""Branch and bounds over caps: on the bottleneck, and on the stages' parameters.

:func:`minimize_step` minimizes the step ``S(B) + (M−1)·B`` over a cap B on every stage's
cost, where S(B) is the least ``Σ c_k`` with every ``c_k <= B`` (non-increasing in B).

With data parallelism a split costs ``F + α·max_k P_k``: its pipeline step F plus an
all-reduce proportional to the largest stage's parameters. Let F(A) be the best pipeline
step of splits whose stages all hold at most A parameter bytes; it is non-increasing in A.
Solving at a cap A gives F(A) and a split whose largest stage holds p <= A, so F is
constant on [p, A] and that split is the best there; every cap below p costs at least
``F(A) + α·cap``. Intervals of caps are solved at their top and halved until their bound
cannot beat the best split found. Parameter sizes are whole bytes, so the caps below p
start at ``p − 1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic, TypeVar

from autopipe.planning.split.tolerances import SAME_TIME

__all__ = []


T = TypeVar("T")
# solve(cap, limit) -> (F(cap), largest stage parameters of its split, the split), or None
# when nothing fits; F may be any value >= limit when it provably reaches the limit. The
# cap is exact: a split's stages hold at most ``cap`` bytes (a slack admitting the last
# peak at ``peak − 1`` would find the same split again and again, to the budget's end).
Solver = Callable[[float, float], "tuple[float, float, T] | None"]


class CapResult(Generic[T]):
    """The best ``F + α·p`` found, its split, and a lower bound on the true optimum."""

    def __init__(self, value: float, split: T, bound: float) -> None:
        self.value = value
        self.split = split
        self.bound = bound


def minimize_over_caps(
    solve: Solver[T],
    alpha: float,
    floor: float,
    *,
    stop: float = math.inf,
    max_solves: int = 200,
) -> CapResult[T] | None:
    """Minimizes ``F(A) + α·p(A)`` over caps ``A >= floor`` (see the module docstring).

    Args:
        solve: the pipeline solver under a cap.
        alpha: all-reduce seconds per parameter byte.
        floor: a cap below which nothing can fit (e.g. ``max(P/K, largest layer)``).
        stop: a value beyond interest: intervals that cannot beat it are dropped.
        max_solves: a budget on calls to ``solve`` after the first.

    Returns:
        ``None`` when nothing fits. Otherwise ``bound`` is a lower bound on the optimum; it
        equals ``value`` (the optimum) unless the optimum is at least ``stop`` or the
        budget ran out.
    """
    first = solve(math.inf, stop - alpha * floor)
    if first is None:
        return None
    free, peak, split = first
    best, best_split = free + alpha * peak, split
    bound = math.inf
    stack = [(floor, peak - 1.0, free)]
    solves = 0
    while stack:
        lo, hi, lower = stack.pop()
        target = min(best, stop)
        if hi < lo:
            continue
        if lower + alpha * lo >= target or solves >= max_solves:
            if target < best or solves >= max_solves:
                bound = min(bound, lower + alpha * lo)
            continue
        solves += 1
        found = solve(hi, target - alpha * lo)
        if found is None:  # nothing fits with caps up to hi
            continue
        value, peak, split = found
        if value + alpha * lo >= target:
            if target < best:
                bound = min(bound, value + alpha * lo)
            continue
        if value + alpha * peak < best:
            best, best_split = value + alpha * peak, split
        hi = peak - 1.0
        mid = 0.5 * (lo + hi)
        stack.append((lo, mid, value))
        stack.append((mid, hi, value))
    return CapResult(best, best_split, min(best, bound))


def minimize_step(
    chunks: int, bound: float, solve: Callable[[float], tuple[float, float, T]]
) -> tuple[float, T]:
    """The least ``Σ c + (M−1)·max c`` over splits, by branch and bound over the cap B.

    Args:
        chunks: micro-batches M.
        bound: the smallest feasible bottleneck B* (the min-max optimum).
        solve: ``solve(B) -> (Σ c, max c, split)`` of the split with the least ``Σ c``
            whose stages all cost at most B (B >= B*, so one exists).

    Returns:
        The least step time and its split.
    """
    best: list[tuple[float, T]] = []

    def run(limit: float) -> tuple[float, float]:
        total, peak, split = solve(limit)
        value = total + (chunks - 1) * peak
        if not best or value < best[0][0]:
            best[:] = [(value, split)]
        return total, peak

    floor_sum, _ = run(math.inf)
    if chunks == 1:
        return best[0]
    lo_sum, _ = run(bound)
    # F(B) = (M−1)·B + S(B) with S non-increasing: bounds past this cannot win.
    ceiling = max(bound, (best[0][0] - floor_sum) / (chunks - 1))
    hi_sum, _ = run(ceiling)
    # Each interval (lo, hi] carries S(lo) and S(hi); a split whose bottleneck lies inside
    # costs more than (M−1)·lo + S(hi).
    stack = [(bound, lo_sum, ceiling, hi_sum)]
    while stack:
        lo, lo_sum, hi, hi_sum = stack.pop()
        if hi - lo <= SAME_TIME * hi or hi_sum >= lo_sum * (1 - SAME_TIME):
            continue
        if (chunks - 1) * lo + hi_sum >= best[0][0] * (1 - SAME_TIME):
            continue
        mid = 0.5 * (lo + hi)
        mid_sum, mid_peak = run(mid)
        # S is constant on [mid_peak, mid], where the split just found is the best. (The
        # peak can exceed mid by the comparison slack; clamping keeps intervals shrinking.)
        stack.append((lo, lo_sum, min(mid_peak, mid), mid_sum))
        stack.append((mid, mid_sum, hi, hi_sum))
    return best[0]
