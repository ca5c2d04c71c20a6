"""Fast lower bounds on a configuration's best step time, from a relaxed min-max partition.

The relaxation keeps stage costs additive so that a greedy probe (Nicol's) or a reachability
sweep, O(K) or O(K·L) per probe, decides whether a bottleneck is feasible:

* each stage's cost is ``W_μ(s,e) / speed_k + o + t_k`` where ``t_k`` is the smallest
  send any non-last stage can have (the true send depends on where the stage ends);
* memory is exact: per start s, the largest end whose memory fits (boundary input
  included); the greedy probe is used only when these ends never fall as s grows;
* with ``auto`` a stage may use any mode whose memory fits, at that mode's cost, or
  re-compute a set of its units (fitting when re-computing all that free bytes does, at
  no cost beyond keeping everything);
  ``Σ c_k`` is bounded by the fastest mode's total and the smallest sends.

Every real split is feasible in the relaxation at no higher cost, so the relaxed optimum
``Σ_lo + (M−1)·B* (+ α·A*)`` bounds the real one from below; bisection on B finds B*, and
:mod:`autopipe.planning.split.capsearch` adds the all-reduce term as
:mod:`autopipe.planning.split.exact` does. Without
transfer costs and with a fixed checkpoint mode the bound is the optimum. Positions where no
cut may go (:mod:`autopipe.planning.model.cut_rules`) are no stage ends here either.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.spans import prefix_sums, stage_bounds, stage_spans
from autopipe.planning.split.capsearch import minimize_over_caps
from autopipe.planning.split.stage_limits import MemoryCache, MemoryLimits
from autopipe.planning.split.tolerances import BISECT_RELAXED

__all__ = []

Array = NDArray[np.float64]
Ints = NDArray[np.int64]


class Relaxation:
    """The relaxed problem of one cost model (see the module docstring)."""

    def __init__(self, model: CostModel, cache: MemoryCache | None = None) -> None:
        """Args:
        model: the configuration's cost model.
        cache: shared among relaxations of models with the same ``layers`` object, it
            keeps the memory limits of stages computed for one for the others.
        """
        self.model = m = model
        self._cache = {} if cache is None else cache
        layers = m.layers
        n, stages = m.num_layers, m.num_stages
        self.n, self.stages = n, stages
        self.work = [
            prefix_sums(layers.forward * (1 + m.fraction(mu)) + layers.backward) for mu in m.modes
        ]
        if m.checkpoint == "auto":
            # Re-computing units (the memory limits' last mode) costs at least nothing more.
            self.work.append(self.work[0])
        self.work_lists = [w.tolist() for w in self.work]
        # Tied tensors once (at their first user): a stage's parameters from below.
        once = layers.first_use()[0]
        self.params = prefix_sums(once)
        self.param_list = self.params.tolist()
        self.speed = [d.speed for d in m.devices]
        boundary = float(layers.output[:-1].min()) if n > 1 else 0.0
        self.fixed = [
            m.overhead
            + (boundary / d.bandwidth if d.bandwidth and k < stages - 1 else 0.0)
            + (d.latency if k < stages - 1 else 0.0)
            for k, d in enumerate(m.devices)
        ]
        self.total = float(self.work[0][-1]) / max(self.speed) + sum(self.fixed)
        bandwidths = {d.bandwidth for d in m.devices}
        if stages > 1 and len(bandwidths) == 1 and None not in bandwidths:
            # The K−1 cuts send K−1 distinct boundaries: at least the K−1 smallest.
            smallest = np.partition(layers.output[:-1], stages - 2)[: stages - 1]
            extra = float(smallest.sum()) - (stages - 1) * boundary
            self.total += extra / float(bandwidths.pop())  # type: ignore[arg-type]
        self.max_param = float(layers.params.max())  # a stage holds all of a layer
        self.extra = 0.0
        self._build_memory()

    def _build_memory(self) -> None:
        limits = MemoryLimits(self.model, self._cache, self.extra)
        self.mem_ends, self.mem_lists = limits.ends, limits.lists
        self.env_lists, self.monotone = limits.envelopes, limits.monotone
        singles: dict[tuple[float, ...], float] = {}
        for k in range(self.stages):
            sign = (*map(float, map(id, self.mem_ends[k])), self.speed[k], self.fixed[k])
            if sign not in singles:
                singles[sign] = self._single_costs(k)
        # From this bottleneck on every layer fits every stage alone; with memory limits
        # that only grow with the start, the greedy probe is then exact.
        self.greedy_from = max(singles.values())
        self.singles_fit = bool(np.isfinite(self.greedy_from))

    def _single_costs(self, k: int) -> float:
        """The smallest bottleneck at which every single layer fits stage ``k`` alone."""
        starts = np.arange(self.n)
        best = np.full(self.n, np.inf)
        for i, ends in enumerate(self.mem_ends[k]):
            cost = np.diff(self.work[i]) / self.speed[k] + self.fixed[k]
            best = np.minimum(best, np.where(ends > starts, cost, np.inf))
        return float(best.max())

    # -- probes -----------------------------------------------------------------------
    def stage_cost(self, k: int, s: int, e: int, envelope: bool = False) -> float:
        """The relaxed cost of stage ``k`` on ``[s, e)``; ``inf`` if no mode fits."""
        best = math.inf
        limits = (self.env_lists if envelope else self.mem_lists)[k]
        for i, work in enumerate(self.work_lists):
            if limits[i][s] >= e:
                best = min(best, (work[e] - work[s]) / self.speed[k] + self.fixed[k])
        return best

    def bottleneck(self, balance: list[int], envelope: bool = False) -> float:
        return max(
            self.stage_cost(k, s, e, envelope) for k, (s, e) in enumerate(stage_spans(balance))
        )

    def probe(
        self, limit: float, cap: float = math.inf, envelope: bool = False
    ) -> list[int] | None:
        """A split with every relaxed stage cost <= ``limit`` and parameters <= ``cap``.

        With ``envelope`` the memory limits are relaxed to their running maxima.
        """
        if (
            not (envelope or self.monotone)
            or self.model.restricted  # the greedy probe would cut anywhere
            or not self.singles_fit
            or limit < self.greedy_from
            or cap < self.max_param
        ):
            return self._reach(limit, cap, envelope)
        pos, ends = 0, []
        params = self.param_list
        for k in range(self.stages):
            budget = (limit - self.fixed[k]) * self.speed[k]
            end = pos
            for i, work in enumerate(self.work_lists):
                by_cost = bisect.bisect_right(work, work[pos] + budget) - 1
                end = max(end, min(by_cost, self.env_lists[k][i][pos]))
            if cap < math.inf:
                end = min(end, bisect.bisect_right(params, params[pos] + cap) - 1)
            end = min(end, self.n - (self.stages - 1 - k))
            if end <= pos:
                return None
            ends.append(end)
            pos = end
        return np.diff([0, *ends]).tolist() if pos == self.n else None

    def _reach(self, limit: float, cap: float, envelope: bool) -> list[int] | None:
        n = self.n
        starts = np.arange(n)
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        history = []
        by_cost: dict[tuple[int, float, float], Ints] = {}
        by_cap = np.searchsorted(self.params, self.params[:n] + cap, side="right") - 1
        for k in range(self.stages):
            budget = (limit - self.fixed[k]) * self.speed[k]
            end = starts.copy()
            for i, work in enumerate(self.work):
                key = (i, budget, 0.0)
                if key not in by_cost:
                    by_cost[key] = np.searchsorted(work, work[:n] + budget, side="right") - 1
                limits = self.mem_ends[k][i]
                if envelope:
                    limits = np.maximum.accumulate(limits)
                end = np.maximum(end, np.minimum(by_cost[key], limits))
            end = np.minimum(np.minimum(end, by_cap), n - (self.stages - 1 - k))
            valid = reach[:n] & (end > starts)
            marks = np.bincount(starts[valid] + 1, minlength=n + 2)
            marks -= np.bincount(end[valid] + 1, minlength=n + 2)
            history.append((reach, end))
            reach = np.cumsum(marks)[: n + 1] > 0
            if self.model.restricted and k < self.stages - 1:  # no stage ends there
                reach &= ~self.model.forbidden
        if not reach[n]:
            return None
        balance, e = [], n
        for k in range(self.stages - 1, -1, -1):
            before, end = history[k]
            p = int(np.flatnonzero(before[:e] & (end[:e] >= e))[-1])
            balance.append(e - p)
            e = p
        return balance[::-1]

    # -- optimization -----------------------------------------------------------------
    def _bisect(
        self, cap: float, stop: float, lo: float, envelope: bool
    ) -> tuple[float, list[int]] | None:
        best = self.probe(math.inf, cap, envelope)
        if best is None:
            return None
        hi = self.bottleneck(best, envelope)
        if lo >= hi:
            return hi, best
        found = self.probe(lo, cap, envelope)
        if found is not None:
            return self.bottleneck(found, envelope), found
        while hi - lo > BISECT_RELAXED * hi and lo < stop:
            mid = 0.5 * (lo + hi)
            found = self.probe(mid, cap, envelope)
            if found is None:
                lo = mid
            else:
                best, hi = found, self.bottleneck(found, envelope)
        return lo, best

    def minmax(
        self, cap: float = math.inf, stop: float = math.inf
    ) -> tuple[float, list[int]] | None:
        """``(lower bound on B*, a split within rtol of it)`` under the parameter cap.

        ``None`` when nothing fits; stops early, returning a bound >= ``stop``, once the
        bottleneck provably reaches ``stop``. Without monotone memory the fast greedy
        bisection on the relaxed limits comes first; exact probes then only confirm it or
        continue from its bound.
        """
        lo = max(self.total / self.stages, min(self.fixed))
        found = self._bisect(cap, stop, lo, envelope=True)
        if found is None or self.monotone or found[0] >= stop:
            return found
        lower, split = found
        upper = self.bottleneck(split, envelope=True)
        exact = self._reach(upper, cap, envelope=False)
        if exact is not None:
            return lower, exact
        return self._bisect(cap, stop, upper, envelope=False)

    def pipeline(self, bottleneck: float) -> float:
        """The relaxed step time of a bottleneck: ``Σ_lo + (M−1)·B``."""
        return self.total + (self.model.chunks - 1) * bottleneck

    def max_params(self, balance: list[int]) -> float:
        bounds = stage_bounds(balance)
        return float(np.max(self.params[bounds[1:]] - self.params[bounds[:-1]]))

    def lower_bound(self, stop: float = math.inf) -> tuple[float, list[int]] | None:
        """A lower bound on the best step time and the relaxed split that attains it.

        Returns ``None`` when no split fits even relaxed. A bound below ``stop`` is the
        relaxed optimum; one at or above ``stop`` only proves that nothing beats ``stop``.
        """
        chunks, alpha = self.model.chunks, self.model.step_factor
        floor = max(float(self.params[-1]) / self.stages, self.max_param)

        def solve(cap: float, limit: float) -> tuple[float, float, list[int]] | None:
            if chunks == 1:
                split = self.probe(math.inf, cap)
                if split is None:
                    return None
                return self.total, self.max_params(split), split
            found = self.minmax(cap, (limit - self.total) / (chunks - 1))
            if found is None:
                return None
            return self.pipeline(found[0]), self.max_params(found[1]), found[1]

        if alpha == 0 or self.stages == 1:
            found = solve(math.inf, stop)
            return None if found is None else (found[0] + alpha * found[1], found[2])
        result = minimize_over_caps(solve, alpha, floor, stop=stop)
        return None if result is None else (result.bound, result.split)

    def shortfall(self, rtol: float = 0.01) -> float:
        """The fewest extra bytes per device with which some split fits memory.

        Memory limits are exact here, so this is the real shortfall, from below to a
        relative ``rtol``; ``0`` when a split fits already.
        """
        base = self.extra

        def fits(extra: float) -> bool:
            self.extra = extra
            self._build_memory()
            return self.probe(math.inf) is not None

        try:
            if fits(base):
                return 0.0
            lo, hi = base, base + max(self.model.capacity(0), 1.0)
            while not fits(hi):
                lo, hi = hi, 2 * hi
            while hi - lo > rtol * hi:
                mid = 0.5 * (lo + hi)
                lo, hi = (lo, mid) if fits(mid) else (mid, hi)
            return lo - base
        finally:
            self.extra = base
            self._build_memory()
