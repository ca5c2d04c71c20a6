"""Which units of a stage to re-compute so that it fits its memory at the least cost.

Re-computing unit ``u`` of a stage (running it under activation checkpointing on every
micro-batch) keeps only its input ``in_u`` per micro-batch in flight instead of its saved
tensors, and runs its forward ``F_u`` once more in the backward. Against keeping
everything it frees, per micro-batch in flight::

    b_u = kept_u − in_u,   kept_u = saved_u − shared_u   (the stage's first unit: saved_u)

(``shared_u``, the part of ``saved_u`` the previous unit saves too, is held once with the
previous unit). So a stage of layers ``[s, e)`` holding ``n`` micro-batches, re-computing
the set R, needs::

    memory(R) = fixed + n · (Σ_{u∈[s,e)} kept_u − Σ_{u∈R} b_u) + [R ≠ ∅] · T(s, e)
    time(R)   = Σ_{u∈R} F_u   (per micro-batch, on a speed-1 device)

where ``T(s, e)``, the largest saved set of the stage's units, is what a unit's
re-computation holds again while its backward runs (one micro-batch's, one unit at a
time: the largest of the stage's, an upper bound of the largest of R's). The
input of a re-computed unit is counted whole even where the previous unit also saves it
(an upper bound as well).

Under split backward (``zb``, ``zbv``, ``dualpipev``) the weights' gradients run after the
input's and need every unit's activations, so a re-computed micro-batch keeps its reduced
set ``a(R) = Σ kept_u − Σ_{u∈R} b_u`` only until its input-gradient pass and its full set
from then until its weights' (:mod:`autopipe.planning.schedules.split_holding`): with the
stage's ``(c, y)`` pairs from the replayed order (:class:`Holding`)::

    memory(R) = fixed + max_p (c_p · a(R) + y_p · Σ kept_u)        (R ≠ ∅)

with no ``T`` (the full set counts already), and ``n · Σ kept_u`` for R = ∅ as above.
Both are the same covering knapsack: the bytes to free per micro-batch are the largest
``kept − (headroom − y_p·kept)/c_p`` over the pairs.

The cheapest R that fits is a covering knapsack: the least ``Σ F_u`` with
``Σ b_u >= need``. It is solved exactly from the Pareto front of (bytes freed, seconds)
over the subsets of the stage's units, built per stage start as the stage grows unit by
unit and shared by every stage of the same units wherever it starts (:class:`UnitRecompute`):
a front of identical blocks has one point per count of units, of other stages at most the
distinct sums. A front past :data:`FRONT_LIMIT` points is thinned to that many (evenly over
the bytes freed, its ends kept), which may cost a little more re-computation than the best
set; fronts that large need hundreds of distinct units in one stage.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.layer_costs import LayerCosts
from autopipe.planning.model.spans import RangeMax

__all__: list[str] = []

Array = NDArray[np.float64]
Index = NDArray[np.int64]

FRONT_LIMIT = 512
# Per figures object (by id, while it lives): its instance, see UnitRecompute.of.
_SHARED: dict[int, tuple[weakref.ref[LayerCosts], UnitRecompute]] = {}


@dataclass(frozen=True)
class Holding:
    """How many micro-batches a stage holds, and how, at the moments that may set its peak.

    Attributes:
        n: micro-batches in flight when nothing is re-computed (each keeps its full set).
        pairs: ``(c, y)`` per moment: ``c`` keep their reduced set, ``y`` their full set.
        transient: a unit's re-computation holds its saved set again on top (one
            micro-batch's, one unit at a time: ``T``); false under split backward, where
            the full sets the pairs count cover it.
    """

    n: int
    pairs: tuple[tuple[int, int], ...]
    transient: bool = True

    @classmethod
    def whole(cls, n: int) -> Holding:
        """A stage whose backward runs whole: ``n`` micro-batches keep their reduced set."""
        return cls(n, ((n, 0),))

    def memory(
        self, kept: Array, freed: Array, transient: Array, rebuilt: Array | float = 0.0
    ) -> Array:
        """Activation bytes when each micro-batch frees ``freed`` of its ``kept`` bytes.

        ``rebuilt``: bytes each micro-batch's backward re-builds beyond ``kept`` (its
        norms' outputs), held with its full set. Where nothing is freed, the stage keeps
        everything: ``n·kept`` plus the most full sets' ``rebuilt`` (an upper bound).
        """
        held = np.zeros(np.shape(kept))
        for c, y in self.pairs:
            held = np.maximum(held, c * (kept - freed) + y * (kept + rebuilt))
        if self.transient:
            held = held + transient
        most = max(y for _, y in self.pairs)
        return np.where(np.asarray(freed) > 0, held, self.n * kept + most * rebuilt)

    def need(
        self, kept: Array, headroom: Array, transient: Array, rebuilt: Array | float = 0.0
    ) -> Array:
        """The bytes per micro-batch to free so that :meth:`memory` fits ``headroom``
        (``inf`` where no freeing fits)."""
        room = headroom - (transient if self.transient else 0.0)
        need = np.full(np.shape(kept), -np.inf)
        fits = room > 0
        for c, y in self.pairs:
            left = room - y * (kept + rebuilt)
            if c > 0:
                need = np.maximum(need, kept - left / c)
            else:
                fits &= left >= 0
        return np.where(fits, need, np.inf)


class Front:
    """The Pareto front of the subsets of some units: bytes freed (ascending) against
    seconds (ascending), with each point's subset as a bit mask over the units' offsets."""

    __slots__ = ("freed", "masks", "seconds")

    def __init__(self, freed: Array, seconds: Array, masks: list[int]) -> None:
        self.freed = freed
        self.seconds = seconds
        self.masks = masks

    @classmethod
    def empty(cls) -> Front:
        return cls(np.zeros(1), np.zeros(1), [0])

    def add(self, benefit: float, cost: float, bit: int) -> Front:
        """The front of the subsets of these units and one more, which frees ``benefit``
        bytes for ``cost`` seconds."""
        if benefit <= 0:  # a unit whose input outweighs its saved tensors never helps
            return self
        freed = np.concatenate([self.freed, self.freed + benefit])
        seconds = np.concatenate([self.seconds, self.seconds + cost])
        masks = self.masks + [m | bit for m in self.masks]
        # Most freed first (ties: the cheaper first); a point stays when it is cheaper than
        # every point that frees at least as much.
        order = np.lexsort((seconds, -freed))
        ordered = seconds[order]
        cheapest = np.minimum.accumulate(ordered)
        keep = np.ones(len(order), dtype=bool)
        keep[1:] = ordered[1:] < cheapest[:-1]
        chosen = order[keep][::-1]
        if len(chosen) > FRONT_LIMIT:
            picks = np.unique(np.linspace(0, len(chosen) - 1, FRONT_LIMIT).round().astype(int))
            chosen = chosen[picks]
        return Front(freed[chosen], seconds[chosen], [masks[i] for i in chosen.tolist()])

    def cheapest(self, need: float) -> int:
        """The index of the cheapest point freeing at least ``need`` bytes, or -1."""
        i = int(np.searchsorted(self.freed, need, side="left"))
        return i if i < len(self.freed) else -1


class UnitRecompute:
    """The cheapest set of units to re-compute for any candidate stage.

    Args:
        layers: per-layer figures (forward seconds, saved, shared, input and output bytes).
    """

    def __init__(self, layers: LayerCosts) -> None:
        self.n = n = len(layers)
        self.forward = layers.forward
        self.saved = layers.saved
        inputs = np.concatenate([[layers.input], layers.output[:-1]])
        self.shared = layers.shared_bytes
        self.kept_inner = layers.saved - self.shared
        self.inputs = inputs
        self._kept = np.concatenate([[0.0], np.cumsum(self.kept_inner)])
        self._largest = RangeMax(layers.saved) if n else None
        # Per unit as a stage's inner unit: the bytes re-computing it frees (when it frees
        # any) and the seconds that costs, as prefix sums.
        gain = self.kept_inner - inputs
        self._gain = np.concatenate([[0.0], np.cumsum(np.maximum(gain, 0.0))])
        self._gain_cost = np.concatenate([[0.0], np.cumsum(np.where(gain > 0, self.forward, 0.0))])
        self._fronts: list[list[Front]] = [[] for _ in range(n)]
        # Stages of the same units (identical blocks) have the same front wherever they
        # start: a stage is keyed by its first unit's item and a 128-bit hash of the
        # multiset of its other units' items (random weights per distinct item, summed).
        items = np.stack([np.where(gain > 0, gain, 0.0), np.where(gain > 0, self.forward, 0.0)])
        _, kind = np.unique(items, axis=1, return_inverse=True)
        weights = np.random.default_rng(0x5EED).integers(1, 2**63, (2, int(kind.max()) + 1))
        weights[:, np.unique(kind[gain <= 0])] = 0  # units that free nothing are no items
        zero = np.zeros((2, 1), dtype=np.int64)
        with np.errstate(over="ignore"):  # sums modulo 2**64 are all a hash needs
            self._hash = np.concatenate([zero, np.cumsum(weights[:, kind.ravel()], axis=1)], axis=1)
        self._by_content: dict[tuple[int, ...], Front] = {}

    @classmethod
    def of(cls, layers: LayerCosts) -> UnitRecompute:
        """The one instance for ``layers``: the search builds a cost model per
        configuration over the same figures, and the fronts depend on those alone."""
        key = id(layers)
        found = _SHARED.get(key)
        if found is None or found[0]() is not layers:
            found = (weakref.ref(layers), cls(layers))
            _SHARED[key] = found
            weakref.finalize(layers, _SHARED.pop, key, None)
        return found[1]

    def benefit(self, u: int, s: int) -> float:
        """Bytes per micro-batch re-computing unit ``u`` frees in a stage starting at ``s``."""
        kept = self.saved[u] if u == s else self.kept_inner[u]
        return float(kept - self.inputs[u])

    def front(self, s: int, e: int) -> Front:
        """The front of the units of stage ``[s, e)``."""
        fronts = self._fronts[s]
        if not fronts:
            fronts.append(Front.empty())
        while len(fronts) <= e - s:
            u = s + len(fronts) - 1
            fronts.append(fronts[-1].add(self.benefit(u, s), float(self.forward[u]), 1 << (u - s)))
        return fronts[e - s]

    def kept(self, s: Index, e: Index) -> Array:
        """Bytes one micro-batch keeps in stage ``[s, e)`` when nothing is re-computed."""
        return np.asarray(self._kept[e] - self._kept[s] + self.shared[s])

    def transient(self, s: Index, e: Index) -> Array:
        """The largest saved set of the stage's units (held again while re-computing)."""
        assert self._largest is not None
        return self._largest.query(np.asarray(s), np.asarray(e))

    def choose(
        self,
        s: Index,
        e: Index,
        holding: Holding,
        headroom: Array,
        rebuilt: Array | float = 0.0,
    ) -> tuple[Array, Array, Array, NDArray[np.bool_]]:
        """Per candidate stage ``[s, e)``: ``(seconds, memory, reduced, fits)`` of its
        cheapest set.

        Args:
            s, e: the candidate stages' bounds (arrays of one shape).
            holding: the micro-batches the stage holds at its candidate peaks.
            headroom: bytes of the device left for the micro-batches' activations (its
                capacity less the stage's state and transient peaks).
            rebuilt: per candidate stage, the bytes a micro-batch's backward re-builds
                beyond its saved set, held with its full set (:meth:`Holding.memory`).

        Returns:
            The re-computation seconds per micro-batch (speed 1) of the cheapest set that
            fits, the activation bytes it holds and the bytes a micro-batch keeps until
            its backward; where none fits, those of the set that frees the most (``fits``
            false).
        """
        s_arr, e_arr = np.broadcast_arrays(np.asarray(s), np.asarray(e))
        head = np.broadcast_to(np.asarray(headroom, dtype=float), s_arr.shape)
        again = np.broadcast_to(np.asarray(rebuilt, dtype=float), s_arr.shape)
        reduced = np.array(self.kept(s_arr, e_arr), dtype=float)
        memory = holding.memory(reduced, np.zeros(s_arr.shape), np.zeros(s_arr.shape), again)
        seconds = np.zeros(s_arr.shape)
        over = memory > head
        if not over.any():
            return seconds, memory, reduced, ~over
        # Solvers ask for the same stages many times over (every split holding them): each
        # distinct stage is looked at once.
        key = s_arr[over].astype(np.int64) * (self.n + 1) + e_arr[over]
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        starts, ends = s_arr[over][first], e_arr[over][first]
        heads = head[over][first]
        rebuilds = again[over][first]
        kept = self.kept(starts, ends)
        transient = self.transient(starts, ends)
        most, slowest = self.most_freed(starts, ends)
        need = holding.need(kept, heads, transient, rebuilds)
        # Where even every unit that frees bytes re-computed does not fit, that set is the
        # answer (the least memory) and no search is needed; the rest search their front,
        # all the stages of one front at once.
        found_s = slowest.copy()
        found_m = holding.memory(kept, most, transient, rebuilds)
        found_r = kept - most
        search = np.flatnonzero(need <= most)
        if len(search):
            a, b = starts[search], ends[search]
            first = np.maximum(self.saved[a] - self.inputs[a], 0.0)
            with np.errstate(over="ignore"):
                hashes = self._hash[:, b] - self._hash[:, a + 1]
            # One integer row per stage: its first item's bits and the two hashes.
            first_item = np.stack([first, np.where(first > 0, self.forward[a], 0.0)])
            content = np.concatenate([first_item.view(np.int64), hashes])
            _, where, group = np.unique(content, axis=1, return_index=True, return_inverse=True)
            group = group.ravel()
            for g, i in enumerate(where.tolist()):
                members = search[group == g]
                key = tuple(int(x) for x in content[:, i])
                front = self._by_content.get(key)
                if front is None:
                    front = self.front(int(a[i]), int(b[i]))
                    self._by_content[key] = front
                j = np.searchsorted(front.freed, need[members], side="left")
                found_s[members] = front.seconds[j]
                freed = front.freed[j]
                found_m[members] = holding.memory(
                    kept[members], freed, transient[members], rebuilds[members]
                )
                found_r[members] = kept[members] - freed
        seconds[over] = found_s[inverse.ravel()]
        memory[over] = found_m[inverse.ravel()]
        reduced[over] = found_r[inverse.ravel()]
        return seconds, memory, reduced, memory <= head

    def most_freed(self, s: Index, e: Index) -> tuple[Array, Array]:
        """``(bytes, seconds)`` per micro-batch of re-computing every unit of ``[s, e)``
        that frees bytes: the most a stage can free, and what it costs."""
        s, e = np.asarray(s), np.asarray(e)
        first = np.maximum(self.saved[s] - self.inputs[s], 0.0)
        inner = s + 1
        freed = first + self._gain[e] - self._gain[inner]
        cost = (
            np.where(first > 0, self.forward[s], 0.0) + self._gain_cost[e] - self._gain_cost[inner]
        )
        return np.asarray(freed), np.asarray(cost)

    def _pick(
        self, s: int, e: int, holding: Holding, headroom: float, rebuilt: float = 0.0
    ) -> tuple[int, Front, float, float]:
        """The front point :meth:`choose` takes for stage ``[s, e)``, with the front, the
        bytes a micro-batch keeps re-computing nothing, and the re-computation's transient."""
        front = self.front(s, e)
        kept = float(self._kept[e] - self._kept[s] + self.shared[s])
        transient = float(self.transient(np.array(s), np.array(e)))
        need = float(holding.need(np.array(kept), np.array(headroom), np.array(transient), rebuilt))
        j = front.cheapest(need) if np.isfinite(need) else -1
        if j < 0:
            j = len(front.freed) - 1  # the least memory: free the most
        return j, front, kept, transient

    def units(
        self, s: int, e: int, holding: Holding, headroom: float, rebuilt: float = 0.0
    ) -> list[int]:
        """The units (layer indices) :meth:`choose` re-computes in stage ``[s, e)``."""
        kept = float(self._kept[e] - self._kept[s] + self.shared[s])
        if float(holding.memory(np.array(kept), np.array(0.0), np.array(0.0), rebuilt)) <= headroom:
            return []
        j, front, _, _ = self._pick(s, e, holding, headroom, rebuilt)
        mask = front.masks[j]
        return [s + i for i in range(e - s) if mask >> i & 1]
