"""Bárány–Grinberg block partition heuristic, the balancer torchgpipe uses (for comparison)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = []

# Slack on the stop test ``M <= m + 1``: block sums come from prefix-sum differences of
# normalized floats, and rounding must not keep the loop moving on an already-good split.
_EPS = 1e-9


def blockpartition(costs: Sequence[float], stages: int) -> list[int]:
    """Splits ``costs`` into ``stages`` contiguous blocks with a small spread of block sums.

    This is the constructive algorithm of I. Bárány and V. S. Grinberg, "Block partitions
    of sequences", arXiv:1308.2452, which torchgpipe uses as its balancer. With the
    sequence normalized into ``[0, 1]`` and ``P`` a partition into ``k`` blocks with
    largest block sum ``M(P)`` and smallest ``m(P)``, it finds a ``P`` with
    ``M(P) <= m(P) + 1``:

    1. Normalize: ``x_i = (c_i - min c) / (max c - min c)``. If all costs are equal every
       equal-count split is already as even as possible, so that split is returned.
    2. Start from the (almost) equal-count split, the first ``n % k`` blocks one longer.
    3. Take a maximal block ``p`` (the first one). If ``M(P) <= m(P) + 1``, stop.
    4. Otherwise take a minimal block ``q`` closest to ``p`` and move into ``q`` the boundary
       element of its neighbour ``h`` on ``p``'s side. Go to 3.

    Repeating step 4 shifts elements one at a time along the blocks between ``q`` and ``p``,
    away from ``p``, until ``p`` itself gives one up or the stop test passes. The paper lets
    blocks become empty; a pipeline stage may not, so when ``h`` has a single element it is
    refilled with the boundary element of its own neighbour toward ``p``, and so on up to
    the first block with at least two elements (``p`` at the latest: ``M(P) > 1`` there,
    and each element is at most 1). Termination follows the paper's argument: ``q`` gains
    at most 1 on a sum below ``M - 1`` and a refilled block holds one element
    ``<= 1 < M``, so no block reaches ``M``; while ``p`` stays maximal every move carries
    an element one block further from ``p``, which can happen only ``n * (k - 1)`` times;
    when ``p`` loses an element the number of maximal blocks, or ``M`` itself, drops. An
    iteration bound proportional to ``n * k`` backs this up against rounding: if it is hit
    the split with the smallest spread seen so far is returned.

    The heuristic minimizes the spread of block sums, not their maximum, so it is not
    optimal for pipelines: on ``[5] * 7 + [20]`` with 2 stages the normalized sequence is
    ``[0] * 7 + [1]``, the equal split already satisfies the stop test, and it returns
    ``[4, 4]`` (max stage 35) where ``[6, 2]`` gives 30.

    Args:
        costs: non-negative, finite cost of each layer, in order.
        stages: number of blocks ``k``, ``1 <= k <= len(costs)``.

    Returns:
        The number of layers in each stage: ``k`` integers, each at least 1, summing to
        ``len(costs)``.

    Raises:
        ValueError: ``stages`` is out of range, or a cost is negative or not finite.
    """
    values = [float(c) for c in costs]
    n = len(values)
    _check(values, stages)
    k = stages
    if k == 1:
        return [n]
    if k == n:
        return [1] * n

    lo, hi = min(values), max(values)
    if hi == lo:
        return _equal_counts(n, k)
    span = hi - lo
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + (v - lo) / span)

    # bounds[j] is the index of block j's first element; bounds[k] == n.
    bounds = [0]
    for count in _equal_counts(n, k):
        bounds.append(bounds[-1] + count)

    best = list(bounds)
    best_spread = math.inf
    # Each maximal block can be chased for at most n * (k - 1) moves before it shrinks; the
    # factor leaves room for several of those rounds before the bound is trusted instead.
    for _ in range(4 * n * k + 16):
        sums = [prefix[bounds[j + 1]] - prefix[bounds[j]] for j in range(k)]
        high, low = max(sums), min(sums)
        if high - low < best_spread:
            best, best_spread = list(bounds), high - low
        if high <= low + 1.0 + _EPS:
            return _counts(bounds)
        p = sums.index(high)
        q = min((j for j in range(k) if sums[j] == low), key=lambda j: (abs(j - p), j))
        if not _shift_toward(bounds, q, p):
            break
    return _counts(best)


def _shift_toward(bounds: list[int], q: int, p: int) -> bool:
    """Moves one element into block ``q`` from its neighbour on ``p``'s side.

    A neighbour left with nothing is refilled from the next block toward ``p``, so the
    boundaries from ``q``'s up to the first block with two or more elements all move by one.

    Returns:
        False, leaving ``bounds`` unchanged, if every block from ``q``'s neighbour up to
        ``p`` has one element (impossible unless rounding broke ``M(P) > 1``).
    """
    step = 1 if q < p else -1
    # Block j is [bounds[j], bounds[j + 1]). Toward a q on the left, block j gives up its
    # first element by advancing bounds[j]; toward a q on the right, its last one by
    # retreating bounds[j + 1].
    donor = q + step
    while bounds[donor + 1] - bounds[donor] < 2:
        if donor == p:
            return False
        donor += step
    if step == 1:
        for j in range(q + 1, donor + 1):
            bounds[j] += 1
    else:
        for j in range(donor + 1, q + 1):
            bounds[j] -= 1
    return True


def _equal_counts(n: int, k: int) -> list[int]:
    """Splits ``n`` into ``k`` counts that differ by at most one, larger ones first."""
    base, extra = divmod(n, k)
    return [base + 1] * extra + [base] * (k - extra)


def _counts(bounds: list[int]) -> list[int]:
    """Turns block boundaries into per-block element counts."""
    return [b - a for a, b in itertools.pairwise(bounds)]


def _check(values: list[float], stages: int) -> None:
    """Raises ``ValueError`` unless ``values`` can be split into ``stages`` blocks."""
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"stages must be an integer, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > len(values):
        raise ValueError(
            f"cannot split {len(values)} layers into {stages} non-empty stages "
            "(stages must not exceed the number of layers)"
        )
    for i, v in enumerate(values):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"costs must be non-negative and finite, got {v!r} at index {i}")
