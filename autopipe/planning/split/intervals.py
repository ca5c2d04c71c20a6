"""The exact best split of one configuration in O(K·L·log L) per pass, when memory allows.

When every stage's largest fitting end never falls as its start grows (what
:class:`~autopipe.planning.split.screening.Relaxation` calls monotone memory: always without
checkpointing, and whenever checkpointed boundaries are alike), the starts s for which a
stage ``[s, e)`` fits memory, a cap A on its parameters and a cap B on its cost form an
interval ``[lo(e), e)`` for every end e and checkpoint mode. Then

* B is feasible iff a reachability sweep over ends, with prefix counts, reaches the last
  layer (bisection on B gives the min-max bottleneck B*);
* the least ``Σ c_k`` with every ``c_k <= B`` is a dynamic program whose minimum over an
  interval of starts is a range-minimum query, with exact sends and, for ``auto``, each
  stage's fastest fitting mode;

and the branch and bounds of :mod:`autopipe.planning.split.capsearch` turn these into the optimum of
``Σ c_k + (M−1)·max c_k + α·max P_k`` that :func:`autopipe.planning.split.exact.optimal_split` finds
with O(K·L²) passes. A position where no cut may go (:mod:`autopipe.planning.model.cut_rules`) is
no stage end for the sweep and the program: both compare allowed splits only.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.spans import stage_spans
from autopipe.planning.split.capsearch import minimize_over_caps, minimize_step
from autopipe.planning.split.screening import Relaxation
from autopipe.planning.split.tolerances import BISECT_INTERVALS, SAME_TIME

__all__ = []

Array = NDArray[np.float64]
Ints = NDArray[np.int64]


def _range_min(values: Array, lo: Ints, hi: Ints) -> tuple[Array, Ints]:
    """Minimum and its position of ``values[lo:hi]`` for every pair (``lo < hi``)."""
    n = len(values)
    if len(lo) == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    levels = int(np.max(hi - lo)).bit_length()
    table = np.full((levels, n), np.inf)
    index = np.zeros((levels, n), dtype=np.int64)
    table[0], index[0] = values, np.arange(n)
    width = 1
    for level in range(1, levels):
        v, i = table[level - 1], index[level - 1]
        left, right = v[: n - width], v[width:]
        take = right < left
        table[level, : n - width] = np.where(take, right, left)
        index[level, : n - width] = np.where(take, i[width:], i[: n - width])
        width *= 2
    level = np.frexp(hi - lo)[1] - 1
    right = hi - (1 << level)
    a, b = table[level, lo], table[level, right]
    return np.minimum(a, b), np.where(b < a, index[level, right], index[level, lo])


class IntervalSolver:
    """Exact optimization of a configuration whose relaxation has monotone memory."""

    def __init__(self, relaxation: Relaxation, envelope: bool = False) -> None:
        """Args:
        relaxation: the configuration's relaxation, whose memory limits it uses.
        envelope: use their running maxima (a relaxation: its optimum is then a lower
            bound); required unless they are monotone already.
        """
        if not (relaxation.monotone or envelope):
            raise ValueError("the interval solver needs memory limits that never fall")
        self.r = r = relaxation
        self.limits = relaxation.env_lists if envelope else relaxation.mem_lists
        m = r.model
        n = r.n
        self.ends = np.arange(n + 1)
        # Stages with the same speed and link share their cost caps' starts.
        groups: dict[tuple[float, float | None, float], int] = {}
        self.group = [
            groups.setdefault((d.speed, d.bandwidth, d.latency), len(groups)) for d in m.devices
        ]
        self.fixed = [m.overhead + m.transfer_time(k, self.ends) for k in range(r.stages)]
        self._cap_starts: tuple[float, Ints] = (math.inf, np.zeros(n + 1, dtype=np.int64))
        # First start whose memory fits a stage ending at e, per stage and mode.
        self.lo_mem = [
            [np.searchsorted(np.maximum.accumulate(ends), self.ends) for ends in row]
            for row in r.mem_ends
        ]
        self.invariant = m.sum_is_invariant()
        self.forbidden, self.restricted = m.forbidden, m.restricted

    def _cost_starts(self, k: int, i: int, limit: float) -> Ints:
        """Per end e, the first start whose cost fits ``limit`` (``e``: none)."""
        r, e = self.r, self.ends
        work = r.work[i]
        budget = (limit * (1 + SAME_TIME) - self.fixed[k]) * r.speed[k]
        lo = np.searchsorted(work, work - budget, side="left")
        return np.where(budget >= 0, np.minimum(lo, e), e)

    def _param_starts(self, cap: float) -> Ints:
        if cap != self._cap_starts[0]:
            params = self.r.params
            # Exact, as in :mod:`autopipe.planning.split.exact`: whole bytes, so the cap search's
            # ``peak − 1`` excludes the peak (a relative slack would admit it again).
            lo = np.searchsorted(params, params - cap, side="left")
            self._cap_starts = (cap, lo)
        return self._cap_starts[1]

    def _all_starts(self, limit: float, cap: float) -> list[list[Ints]]:
        """Per stage and mode, per end e, the first start of a stage that fits."""
        cache: dict[tuple[int, int], Ints] = {}
        by_cap = self._param_starts(cap) if cap < math.inf else None
        out = []
        for k in range(self.r.stages):
            row = []
            for i in range(len(self.r.work)):
                key = (self.group[k], i)
                if key not in cache:
                    cache[key] = self._cost_starts(k, i, limit)
                lo = np.maximum(cache[key], self.lo_mem[k][i])
                row.append(lo if by_cap is None else np.maximum(lo, by_cap))
            out.append(row)
        return out

    def stage_cost(self, k: int, s: int, e: int) -> float:
        r, best = self.r, math.inf
        for i, work in enumerate(r.work_lists):
            if self.limits[k][i][s] >= e:
                best = min(best, (work[e] - work[s]) / r.speed[k] + float(self.fixed[k][e]))
        return best

    def _costs(self, balance: list[int]) -> list[float]:
        return [self.stage_cost(k, s, e) for k, (s, e) in enumerate(stage_spans(balance))]

    def _backtrack(self, choose: list[list[tuple[NDArray[np.bool_], Ints]]]) -> list[int]:
        balance, e = [], self.r.n
        for k in range(self.r.stages - 1, -1, -1):
            start = max(int(pick[e]) for valid, pick in choose[k] if valid[e])
            balance.append(e - start)
            e = start
        return balance[::-1]

    def feasible(self, limit: float, cap: float = math.inf) -> list[int] | None:
        """A split whose stages all cost at most ``limit`` and fit, or ``None``."""
        r, e = self.r, self.ends
        reach = e == 0
        history = []
        for k, row in enumerate(self._all_starts(limit, cap)):
            count = np.concatenate([[0], np.cumsum(reach)])
            nxt = np.zeros(r.n + 1, dtype=bool)
            for starts in row:
                nxt |= (starts < e) & (count[e] > count[np.minimum(starts, e)])
            nxt[r.n - (r.stages - 1 - k) + 1 :] = False
            if self.restricted and k < r.stages - 1:  # no stage ends where no cut may go
                nxt[self.forbidden] = False
            history.append((reach, row))
            reach = nxt
        if not reach[r.n]:
            return None
        balance: list[int] = []
        end = r.n
        for k in range(r.stages - 1, -1, -1):
            before, row = history[k]
            # The last reachable start of any mode's interval [lo, end).
            first = min(int(starts[end]) for starts in row)
            start = first + int(np.flatnonzero(before[first:end])[-1])
            balance.append(end - start)
            end = start
        return balance[::-1]

    def minmax(self, cap: float = math.inf, lower: float = 0.0) -> tuple[float, list[int]] | None:
        """The least bottleneck B* (to a relative 1e-9) and a split attaining it.

        Args:
            cap: the cap on every stage's parameters.
            lower: a known lower bound on B*.
        """
        first = self.feasible(math.inf, cap)
        if first is None:
            return None
        best: list[int] = first
        hi = max(self._costs(best))
        lo = min(max(self.r.total / self.r.stages, lower), hi)
        while hi - lo > BISECT_INTERVALS * hi:
            values = self._candidates(lo, hi)
            if values is not None:
                # B* is one of these stage costs: the least at which a split is feasible.
                low, high = 0, len(values)
                while low < high:
                    middle = (low + high) // 2
                    found = self.feasible(float(values[middle]), cap)
                    if found is None:
                        low = middle + 1
                    else:
                        high = middle
                        if max(self._costs(found)) < hi:
                            best, hi = found, max(self._costs(found))
                return hi, best
            mid = 0.5 * (lo + hi)
            found = self.feasible(mid, cap)
            if found is None or max(self._costs(found)) >= hi:
                lo = mid  # nothing cheaper, up to the slack of the cost caps
            else:
                best, hi = found, max(self._costs(found))
        return hi, best

    def _candidates(self, lo: float, hi: float, most: int = 2048) -> Array | None:
        """Every stage cost in ``(lo, hi)``, sorted, unless there are more than ``most``."""
        r, e = self.r, self.ends
        values, seen, count = [], set(), 0
        for k in range(r.stages):
            for i, work in enumerate(r.work):
                if (self.group[k], i) in seen:
                    continue
                seen.add((self.group[k], i))
                speed, fixed = r.speed[k], self.fixed[k]
                first = np.searchsorted(work, work - (hi - fixed) * speed, side="left")
                stop = np.minimum(np.searchsorted(work, work - (lo - fixed) * speed), e)
                counts = np.maximum(stop - first, 0)
                count += int(counts.sum())
                if count > most:
                    return None
                ends = np.repeat(e, counts)
                offsets = np.arange(len(ends)) - np.repeat(np.cumsum(counts) - counts, counts)
                starts = np.repeat(first, counts) + offsets
                values.append((work[ends] - work[starts]) / speed + fixed[ends])
        return np.unique(np.concatenate([[hi], *values]))

    def minsum(self, limit: float, cap: float = math.inf) -> tuple[float, float, list[int]]:
        """The split with the least ``Σ c_k`` whose stages all cost at most ``limit``."""
        r, e = self.r, self.ends
        best = np.where(e == 0, 0.0, np.inf)
        starts = self._all_starts(limit, cap)
        choose = []
        for k in range(r.stages):
            nxt = np.full(r.n + 1, np.inf)
            options = []
            for i, work in enumerate(r.work):
                lo = np.minimum(starts[k][i], e)
                open_ = lo < e
                value, arg = _range_min(best - work / r.speed[k], lo[open_], e[open_])
                cost = np.full(r.n + 1, np.inf)
                cost[open_] = value + work[open_] / r.speed[k] + self.fixed[k][open_]
                pick = np.zeros(r.n + 1, dtype=int)
                pick[open_] = arg
                options.append((cost < nxt, pick))
                nxt = np.minimum(nxt, cost)
            nxt[r.n - (r.stages - 1 - k) + 1 :] = np.inf
            if self.restricted and k < r.stages - 1:
                nxt[self.forbidden] = np.inf
            # Keep, per end, only the mode that gave the minimum.
            taken = np.zeros(r.n + 1, dtype=bool)
            for j in range(len(options) - 1, -1, -1):
                better, pick = options[j]
                options[j] = (better & ~taken, pick)
                taken |= better
            choose.append(options)
            best = nxt
        assert np.isfinite(best[r.n])  # limit >= the feasible bottleneck
        balance = self._backtrack(choose)
        costs = self._costs(balance)
        return sum(costs), max(costs), balance

    def pipeline(
        self, cap: float = math.inf, stop: float = math.inf
    ) -> tuple[float, list[int]] | None:
        """The least ``Σ c_k + (M−1)·max c_k`` under the parameter cap, and its split.

        A value at or above ``stop`` may be a lower bound from the relaxation.
        """
        chunks = self.r.model.chunks
        lower = 0.0
        if chunks > 1:
            relaxed = self.r.minmax(cap, (stop - self.r.total) / (chunks - 1))
            if relaxed is None:
                return None
            if self.r.pipeline(relaxed[0]) >= stop:
                return self.r.pipeline(relaxed[0]), relaxed[1]
            lower = relaxed[0] if self.limits is self.r.mem_lists else 0.0
        found = self.minmax(cap, lower)
        if found is None:
            return None
        bound, balance = found
        if self.invariant:
            return sum(self._costs(balance)) + (chunks - 1) * bound, balance
        return minimize_step(chunks, bound, lambda limit: self.minsum(limit, cap))

    def solve(self, stop: float = math.inf) -> tuple[float, list[int]] | None:
        """``(the least step time, its split)``; ``None`` when nothing fits.

        A value at or above ``stop`` may be a mere lower bound.
        """
        r = self.r
        alpha = r.model.step_factor

        def run(cap: float, limit: float) -> tuple[float, float, list[int]] | None:
            found = self.pipeline(cap, limit)
            return None if found is None else (found[0], r.max_params(found[1]), found[1])

        floor = max(float(r.params[-1]) / r.stages, r.max_param)
        if alpha == 0 or r.stages == 1:
            first = run(math.inf, stop)
            return None if first is None else (first[0] + alpha * first[1], first[2])
        result = minimize_over_caps(run, alpha, floor, stop=stop, max_solves=10_000)
        return None if result is None else (result.bound, result.split)
