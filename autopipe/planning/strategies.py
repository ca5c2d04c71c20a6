"""Baseline partitioning strategies (DeepSpeed's 'uniform' and 'parameters') for comparison."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autopipe.planning.minmax import minmax_partition
from autopipe.planning.spans import prefix_sums, stage_bounds

__all__ = []


def uniform(n: int, stages: int) -> list[int]:
    """Splits ``n`` layers into ``stages`` stages with equal layer counts.

    As DeepSpeed's ``partition_uniform`` does, the remainder ``n % stages`` goes one extra
    layer each to the first stages.

    Args:
        n: number of layers.
        stages: number of stages, ``1 <= stages <= n``.

    Returns:
        The number of layers in each stage, e.g. ``uniform(10, 4) == [3, 3, 2, 2]``.

    Raises:
        ValueError: ``stages`` is out of range.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"n must be an integer number of layers, got {n!r}")
    _check_stages(n, stages)
    base, extra = divmod(n, stages)
    return [base + 1] * extra + [base] * (stages - extra)


def parameters(params: Sequence[float], stages: int) -> list[int]:
    """Splits layers so that the largest per-stage parameter size is as small as possible.

    This is DeepSpeed's default ``partition_method='parameters'``: weigh each layer by its
    parameter bytes (or count) and balance those, ignoring compute time. The split is the
    exact min-max contiguous split of ``params``; among the optimal splits the one with the
    most even layer counts (least sum of squared counts, then larger counts first) wins, so
    parameter-free layers are spread out instead of piling onto one stage.

    Args:
        params: non-negative, finite parameter bytes of each layer, in order.
        stages: number of stages, ``1 <= stages <= len(params)``.

    Returns:
        The number of layers in each stage: ``stages`` integers, each at least 1, summing
        to ``len(params)``.

    Raises:
        ValueError: ``stages`` is out of range, or a weight is negative or not finite.
    """
    weights = [float(w) for w in params]
    n = len(weights)
    _check_stages(n, stages)
    for i, w in enumerate(weights):
        if not math.isfinite(w) or w < 0:
            raise ValueError(
                f"parameter sizes must be non-negative and finite, got {w!r} at index {i}"
            )
    prefix = prefix_sums(np.asarray(weights, dtype=np.float64))
    limit = _min_max(prefix, stages)
    return _most_even_within(prefix, stages, limit)


def _min_max(prefix: np.ndarray, stages: int) -> float:
    """Returns the least possible largest block sum over splits into ``stages`` blocks.

    Measured on the same prefix differences that ``_most_even_within`` compares, so the
    optimal split itself passes its limit test.
    """
    balance = minmax_partition(np.diff(prefix), stages)
    assert balance is not None  # no memory caps: every split is feasible
    bounds = stage_bounds(balance)
    return float(np.max(prefix[bounds[1:]] - prefix[bounds[:-1]]))


def _most_even_within(prefix: np.ndarray, stages: int, limit: float) -> list[int]:
    """Returns the split with the most even layer counts among those with blocks <= ``limit``.

    A second pass, rather than a tie-break inside ``_min_max``, because "smallest max, then
    most even" does not decompose over prefixes: a prefix with a worse max can still be part
    of an optimal split when a later block sets the max. Block sums are the same
    prefix differences as in ``_min_max``, so the optimal split itself passes the limit test.
    """
    n = len(prefix) - 1
    # cost[j][i]: least sum of squared counts splitting elements i.. into j blocks, each
    # within the limit (inf if impossible).
    cost = np.full((stages + 1, n + 1), np.inf)
    cost[0][n] = 0.0
    for j in range(1, stages + 1):
        for i in range(n - j, -1, -1):
            ends = np.arange(i + 1, n - j + 2)  # the block is [i, end); j - 1 blocks follow
            fits = prefix[ends] - prefix[i] <= limit
            totals = np.where(fits, (ends - i) ** 2 + cost[j - 1][ends], np.inf)
            cost[j][i] = totals.min()

    counts: list[int] = []
    start = 0
    for j in range(stages, 0, -1):
        ends = np.arange(start + 1, n - j + 2)
        fits = prefix[ends] - prefix[start] <= limit
        totals = np.where(fits, (ends - start) ** 2 + cost[j - 1][ends], np.inf)
        # The last (largest) end reaching the optimum puts larger counts first, as uniform().
        end = int(ends[np.flatnonzero(totals == cost[j][start])[-1]])
        counts.append(end - start)
        start = end
    return counts


def _check_stages(n: int, stages: int) -> None:
    """Raises ``ValueError`` unless ``n`` layers can fill ``stages`` non-empty stages."""
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise ValueError(f"stages must be an integer, got {stages!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, got {stages}")
    if stages > n:
        raise ValueError(
            f"cannot split {n} layers into {stages} non-empty stages "
            "(stages must not exceed the number of layers)"
        )
