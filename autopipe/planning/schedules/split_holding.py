"""What a stage holds under split backward when it re-computes, counted from the replay.

Under ``zb``, ``zbv`` and ``dualpipev`` a backward runs in two passes: ``I`` (the input's
gradient, sent on) and ``W`` (the weights' gradients, later). A micro-batch that a stage
re-computes keeps only its reduced set ``a`` (what the re-computation starts from) from its
forward until its ``I``; its ``I`` runs the forward again first, and from then until its
``W`` the full saved set ``b`` is live again (``W`` needs the activations). A whole backward
(``B``, DualPipeV's) is an ``I`` and a ``W`` at once. While the ``I`` runs, the micro-batch
holds both its reduced set and its re-built full set.

So at each moment of a rank's replayed order (:func:`rank_order`) its local stage ``j``
holds ``x_j·a_j + y_j·b_j + z_j·r_j``: ``x_j`` micro-batches between their forward and
their ``I`` (or ``B``), ``y_j`` between ``I`` and ``W``, ``z_j`` = 1 while an ``I`` or ``B``
of stage ``j`` runs (the moment just after it re-built its set), and ``r_j = a_j`` for a
re-computing stage; a stage that keeps everything has ``a_j = b_j`` and ``r_j = 0``, which
gives its micro-batches in flight times ``b_j`` (:func:`in_flight`).

A stage that keeps its saved set ``a`` but re-builds ``r`` more bytes in its ``I`` (its
norms' outputs, :mod:`autopipe.planning.recomputed_modules`) holds ``(x + y)·a + y·r``: the
re-built bytes join the kept set rather than replace it, so ``z`` adds nothing.

:func:`split_moments` lists those ``(x, y, z)`` counts per moment (moments that another
bounds in every count dropped: all bytes are >= 0, so they never set a peak);
:func:`stage_holdings` a stage's own ``(x + z, y)`` pairs, the peak of a re-computing stage
being ``max (x + z)·a + y·b`` over them; :func:`stage_keeps` its ``(x, y)`` pairs, the peak
of one that keeps its saved set being ``max x·a + y·(a + r)``.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.schedules.interleaving import rank_order, rank_stages

__all__: list[str] = []

# The schedules whose backward runs in two passes (``I`` then ``W``) on some micro-batches.
SPLIT_SCHEDULES = ("zb", "zbv", "dualpipev")


def _undominated(rows: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The rows no other row bounds in every column (largest first)."""
    kept: list[tuple[int, ...]] = []
    for row in sorted(rows, reverse=True):
        if not any(all(a >= b for a, b in zip(other, row, strict=True)) for other in kept):
            kept.append(row)
    return kept


@functools.lru_cache(maxsize=256)
def split_moments(
    rank: int, ranks: int, virtual: int, chunks: int, schedule: str
) -> NDArray[np.int64]:
    """The counts ``rank``'s stages hold at each moment that may set its peak.

    Rows: the moments just after each forward and each ``I`` or ``B`` of the replayed
    order, the rows another bounds in every column dropped; columns: per local stage
    (:func:`rank_stages` order) ``x``, ``y`` and ``z`` (see the module docstring), so
    stage ``j``'s are columns ``3j, 3j+1, 3j+2``.

    Raises:
        ValueError: as :func:`rank_order`.
    """
    local_of = {s: j for j, s in enumerate(rank_stages(rank, ranks, virtual, schedule))}
    before = [0] * virtual  # between forward and I (or B)
    after = [0] * virtual  # between I and W
    moments: set[tuple[int, ...]] = set()
    for op, stage, _ in rank_order(rank, ranks, virtual, chunks, schedule):
        j = local_of[stage]
        running = [0] * virtual
        if op == "F":
            before[j] += 1
        elif op in ("I", "B"):
            before[j] -= 1
            after[j] += 1
            running[j] = 1
        else:  # W
            after[j] -= 1
        if op != "W":  # a W only frees
            moments.add(tuple(c for t in zip(before, after, running, strict=True) for c in t))
        if op == "B":  # its weights' part is done with it
            after[j] -= 1
    return np.array(_undominated(moments), dtype=np.int64).reshape(-1, 3 * virtual)


@functools.lru_cache(maxsize=256)
def stage_holdings(
    rank: int, ranks: int, virtual: int, chunks: int, schedule: str
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per local stage of ``rank``, its ``(x + z, y)`` pairs none bounds in both counts.

    A re-computing stage's activations peak at the largest ``(x + z)·a + y·b`` over them:
    ``x + z`` micro-batches keep their reduced set ``a`` (the one in its ``I`` too), ``y``
    their full set ``b``.

    Raises:
        ValueError: as :func:`rank_order`.
    """
    rows = split_moments(rank, ranks, virtual, chunks, schedule)
    out = []
    for j in range(virtual):
        x, y, z = rows[:, 3 * j], rows[:, 3 * j + 1], rows[:, 3 * j + 2]
        kept = _undominated({(int(c), int(d)) for c, d in zip(x + z, y, strict=True)})
        out.append(tuple(sorted((row[0], row[1]) for row in kept)))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def stage_keeps(
    rank: int, ranks: int, virtual: int, chunks: int, schedule: str
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per local stage of ``rank``, its ``(x, y)`` pairs none bounds in both counts.

    A stage that keeps its saved set ``a`` and re-builds ``r`` more in each ``I`` peaks at
    the largest ``x·a + y·(a + r)`` over them (the micro-batch in its ``I`` is one of the
    ``y``).

    Raises:
        ValueError: as :func:`rank_order`.
    """
    rows = split_moments(rank, ranks, virtual, chunks, schedule)
    out = []
    for j in range(virtual):
        x, y = rows[:, 3 * j], rows[:, 3 * j + 1]
        kept = _undominated({(int(c), int(d)) for c, d in zip(x, y, strict=True)})
        out.append(tuple(sorted((row[0], row[1]) for row in kept)))
    return tuple(out)
