"""Per stage and start, the most layers a pipeline stage can hold within its memory."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.cost_model import UNITS_MODE, CostModel
from autopipe.planning.model.spans import RangeMax, prefix_sums

__all__ = []

Array = NDArray[np.float64]
Ints = NDArray[np.int64]
# Per memory signature: the largest fitting end per start (array, list), its running
# maximum (list), and whether the two are the same.
MemoryCache = dict[tuple[object, ...], tuple[Ints, list[int], list[int], bool]]


class MemoryLimits:
    """For every stage k, checkpoint mode μ and start s: the largest end e with
    ``m_k(s, e) <= capacity + extra`` under mode μ (``e = s`` when not even one layer fits).

    Memory grows with e for a fixed start, so these ends say exactly which stages fit.
    They need not grow with s (a later start may keep a larger checkpointed boundary
    input); their running maxima (``envelopes``) do, and relax the limits.

    Attributes:
        ends: per stage and mode, the ends as arrays.
        lists: the same as Python lists (for scalar lookups).
        envelopes: their running maxima, as lists.
        monotone: whether the ends never fall as the start grows (then equal to the
            envelopes).
    """

    def __init__(self, model: CostModel, cache: MemoryCache | None = None, extra: float = 0.0):
        """Args:
        model: the cost model.
        cache: shared by models with the same ``layers`` object (and bytes held per
            parameter byte), so that stages with the same memory signature are computed
            once.
        extra: bytes added to every capacity.
        """
        self.model = m = model
        cache = {} if cache is None else cache
        layers = m.layers
        self.n = m.num_layers
        # Tied tensors once (at their first user): a stage's state from below.
        params, buffers = layers.first_use()
        state = params * m.state_factor + buffers
        self._state = prefix_sums(state if m.expert_state is None else state + m.expert_state)
        # As in the cost model: shared bytes count once, added back at a stage's start.
        self._shared = layers.shared_bytes
        self._saved = prefix_sums(layers.saved - self._shared)
        # The cost model's: bytes the backward re-builds (held with the full sets under
        # split backward) and the layers' transient peaks beyond them.
        self._rebuilt = m.rebuilt_sums
        self._peak = m.peaks
        # Boundary input of a stage starting at s: the model input or layer s−1's output.
        self._inputs = np.concatenate([[layers.input], layers.output[:-1]])
        # ``auto`` re-computing units (:mod:`autopipe.planning.model.unit_recompute`): the
        # least a micro-batch keeps, every unit that frees bytes re-computed, while the
        # largest saved set of the stage is live again.
        units = (UNITS_MODE,) if m.checkpoint == "auto" else ()
        least = np.minimum(layers.saved - self._shared, self._inputs)
        self._least = prefix_sums(least)
        self._least_first = np.minimum(layers.saved, self._inputs) - least
        self._largest = RangeMax(layers.saved)
        self.ends: list[list[Ints]] = []
        self.lists: list[list[list[int]]] = []
        self.envelopes: list[list[list[int]]] = []
        self.monotone = True
        for k in range(m.num_stages):
            ends: list[Ints] = []
            lists: list[list[int]] = []
            envelopes: list[list[int]] = []
            cap = m.capacity(k) + extra
            for mu in (*m.modes, *units):
                holding = m.holding(k, mu)
                key = (
                    id(layers), m.state_factor, m.expert_factor, mu, m.rebuilds, holding, cap
                )  # fmt: skip
                if key not in cache:
                    # Memory grows with the end under every count pair: a stage fits
                    # while it fits under each (split backward has several).
                    found = np.full(self.n, self.n, dtype=np.int64)
                    full = self._saved + self._rebuilt  # y hold what their I re-built too
                    for c, y in holding.pairs:
                        if mu == UNITS_MODE:
                            additive = self._state + c * self._least + y * full
                            const = c * self._least_first + y * self._shared
                            one = self._ends(additive, const, cap, holding.transient)
                        elif mu == "never":  # c keep their saved set
                            additive = self._state + c * self._saved + y * full
                            const = (c + y) * self._shared
                            one = self._ends(additive, const, cap)
                        else:
                            const = c * self._inputs + y * self._shared
                            one = self._ends(self._state + y * full, const, cap)
                        found = np.minimum(found, one)
                    rise = np.maximum.accumulate(found)
                    same = bool((found == rise).all())
                    cache[key] = (found, found.tolist(), rise.tolist(), same)
                array, values, envelope, rising = cache[key]
                ends.append(array)
                lists.append(values)
                envelopes.append(envelope)
                self.monotone = self.monotone and rising
            self.ends.append(ends)
            self.lists.append(lists)
            self.envelopes.append(envelopes)

    def _ends(self, additive: Array, const: Array, cap: float, transient: bool = False) -> Ints:
        """Per start s, the largest end e >= s with ``A(e) − A(s) + const(s) + peak <= cap``
        (``transient``: plus the stage's largest saved set)."""
        starts = np.arange(self.n)
        budget = additive[starts] + (cap - const)
        ends = np.maximum(np.searchsorted(additive, budget, side="right") - 1, starts)
        if self._peak is None and not transient:
            return ends.astype(np.int64)
        # The largest layer peak of the stage also grows with e: bisect on it.
        lo, hi = starts.copy(), ends.astype(np.int64)
        while np.any(lo < hi):
            open_ = lo < hi
            mid = np.where(open_, (lo + hi + 1) // 2, np.minimum(lo + 1, self.n))
            total = additive[mid] - additive[starts] + const
            if self._peak is not None:
                total = total + self._peak.query(starts, mid)
            if transient:
                total = total + self._largest.query(starts, mid)
            ok = open_ & (total <= cap)
            lo = np.where(ok, mid, lo)
            hi = np.where(open_ & ~ok, mid - 1, hi)
        return lo
