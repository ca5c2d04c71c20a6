"""Stage spans of a balance, prefix sums over layers, and whether a split fits memory."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

__all__ = []


class RangeMax:
    """Sparse table for vectorized range-maximum queries over ``[s, e)``, ``s < e``."""

    def __init__(self, values: NDArray[np.float64]) -> None:
        n = len(values)
        self.table = np.zeros((max(n.bit_length(), 1), max(n, 1)))
        self.table[0, :n] = values
        width = 1
        for level in range(1, len(self.table)):
            prev = self.table[level - 1]
            self.table[level, : n - 2 * width + 1] = np.maximum(
                prev[: n - 2 * width + 1], prev[width : n - width + 1]
            )
            width *= 2

    def query(self, s: NDArray[np.int64], e: NDArray[np.int64]) -> NDArray[np.float64]:
        # floor(log2(length)), exactly, from the binary exponent.
        level = np.frexp(e - s)[1] - 1
        return np.asarray(np.maximum(self.table[level, s], self.table[level, e - (1 << level)]))


class StageMemoryModel(Protocol):
    """What the memory checks read of :class:`~autopipe.planning.model.cost_model.CostModel`.

    A protocol rather than an import: the cost model imports this module's prefix sums, so
    naming its class here would make the two modules import each other."""

    @property
    def num_stages(self) -> int: ...

    @property
    def num_ranks(self) -> int: ...

    @property
    def placement(self) -> list[int]: ...

    def stage_costs(self, k: int, s: Any, e: Any) -> tuple[Any, Any, Any]: ...

    def capacity(self, k: int) -> float: ...

    def saved_memory(self, k: int, s: Any, e: Any) -> Any: ...

    def rank_shares(self, rank: int) -> NDArray[np.float64]: ...

    def rank_moments(self, rank: int) -> NDArray[np.int64]: ...

    def held_parts(self, k: int, s: Any, e: Any) -> Any: ...

    @property
    def restricted(self) -> bool: ...

    @property
    def forbidden(self) -> NDArray[np.bool_]: ...


def stage_bounds(balance: Sequence[int]) -> NDArray[np.int64]:
    """Where each stage starts, then where the last ends: ``[0, b₀, b₀+b₁, ..., L]``."""
    return np.cumsum([0, *balance])


def stage_spans(balance: Sequence[int]) -> list[tuple[int, int]]:
    """Each stage's layers ``[s, e)`` as Python integers."""
    bounds = stage_bounds(balance).tolist()
    return list(itertools.pairwise(bounds))


def prefix_sums(values: ArrayLike) -> NDArray[np.float64]:
    """``[0, v₀, v₀+v₁, ...]``: the sum over layers ``[s, e)`` is ``p[e] − p[s]``."""
    if isinstance(values, np.ndarray) and values.dtype == np.float64 and values.ndim == 1:
        # Summed in place after the leading 0: the same sums as below without the copy a
        # concatenation makes, which costs as much as the sums at 10⁶ layers.
        prefix = np.empty(len(values) + 1)
        prefix[0] = 0.0
        np.cumsum(values, out=prefix[1:])
        return prefix
    return np.concatenate([[0.0], np.cumsum(values)])


def stage_memory(model: StageMemoryModel, balance: Sequence[int]) -> NDArray[np.float64]:
    """The peak memory of each stage of ``balance`` under ``model``."""
    bounds = stage_bounds(balance)
    return np.array(
        [
            float(model.stage_costs(k, np.array(bounds[k]), np.array(bounds[k + 1]))[1])
            for k in range(len(balance))
        ]
    )


def stage_saved(model: StageMemoryModel, balance: Sequence[int]) -> NDArray[np.float64]:
    """Of each stage's peak, what its in-flight micro-batches hold (its saved sets)."""
    bounds = stage_bounds(balance)
    return np.array(
        [
            float(model.saved_memory(k, np.array(bounds[k]), np.array(bounds[k + 1])))
            for k in range(len(balance))
        ]
    )


def stage_held(model: StageMemoryModel, balance: Sequence[int]) -> NDArray[np.float64]:
    """Per stage of ``balance``, what one micro-batch holds as :meth:`held_parts` counts
    it (stages, 3): what :func:`rank_memory` takes under split backward."""
    bounds = stage_bounds(balance)
    return np.array(
        [
            np.asarray(model.held_parts(k, np.array(bounds[k]), np.array(bounds[k + 1])))
            for k in range(len(balance))
        ]
    ).reshape(len(balance), 3)


def rank_memory(
    model: StageMemoryModel,
    memory: NDArray[np.float64],
    saved: NDArray[np.float64],
    held: NDArray[np.float64] | None = None,
) -> NDArray[np.float64]:
    """Each rank's peak bytes, per row of stage memories and their saved sets (rows:
    splits, columns: stages): its stages' memory less their saved sets, plus the most the
    rank's saved sets hold at once (:meth:`rank_shares`: its stages do not all peak at the
    same moment). At most the sum of its stages' peaks.

    Under split backward with ``held`` (splits, stages, 3: :meth:`held_parts`) the most
    they hold at once is the largest sum over the rank's stages of the moment's counts
    (:meth:`rank_moments`) times those bytes: a re-computing stage's micro-batches hold
    different bytes before and after their input-gradient pass, so no share of its peak
    says what it holds at another stage's."""
    where = np.asarray(model.placement)
    out = np.empty((len(memory), model.num_ranks))
    for r in range(model.num_ranks):
        stages = [int(k) for k in np.flatnonzero(where == r)]
        # ``rank_shares`` lists a rank's stages in its local order; placement gives
        # them in stage order: the local order of a V rank (r, 2K−1−r) is that order too.
        fixed = (memory[:, stages] - saved[:, stages]).sum(axis=1)
        moments = model.rank_moments(r)
        if held is not None and len(moments):
            parts = held[:, stages, :].reshape(len(memory), -1)
            out[:, r] = fixed + (parts @ moments.T.astype(float)).max(axis=1)
        else:
            out[:, r] = fixed + (saved[:, stages] @ model.rank_shares(r).T).max(axis=1)
    return out


def overflows(
    model: StageMemoryModel,
    memory: NDArray[np.float64],
    saved: NDArray[np.float64] | None = None,
    held: NDArray[np.float64] | None = None,
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Bytes over capacity, per row of stage memories (rows: splits, columns: stages):
    of each stage on its device, and, with virtual stages, of each rank's stages together
    on the rank's device (stage s runs on rank ``model.placement[s]``: ``s % K``, or in a
    V rank r holds r and 2K−1−r; no columns without virtual stages): with the stages'
    ``saved`` sets (and ``held`` parts), as :func:`rank_memory` holds them, else their
    peaks summed. A split fits where no entry is above 0."""
    capacities = np.array([model.capacity(k) for k in range(model.num_stages)])
    stages = memory - capacities
    ranks = model.num_ranks
    if ranks == model.num_stages:
        return stages, np.empty((len(memory), 0))
    if saved is not None:
        peaks = rank_memory(model, memory, saved, held)
    else:
        where = np.asarray(model.placement)
        peaks = np.stack([memory[:, where == r].sum(axis=1) for r in range(ranks)], axis=1)
    # Each rank's device: that of its first stage (stage r in both placements).
    return stages, peaks - capacities[:ranks]


def fits_memory(
    model: StageMemoryModel,
    memory: NDArray[np.float64],
    saved: NDArray[np.float64] | None = None,
    held: NDArray[np.float64] | None = None,
) -> NDArray[np.bool_]:
    """Per row of stage memories (see :func:`overflows`), whether the split fits."""
    stages, ranks = overflows(model, memory, saved, held)
    return np.all(stages <= 0, axis=1) & np.all(ranks <= 0, axis=1)


def split_fits(model: StageMemoryModel, balance: Sequence[int]) -> bool:
    """Whether every stage of ``balance`` (and every rank's stages) fits its device, and
    no cut lies where none may go (:attr:`CostModel.forbidden`)."""
    if model.restricted and model.forbidden[stage_bounds(balance)[1:-1]].any():
        return False
    memory = stage_memory(model, balance)[None, :]
    saved = stage_saved(model, balance)[None, :]
    return bool(fits_memory(model, memory, saved, stage_held(model, balance)[None])[0])
