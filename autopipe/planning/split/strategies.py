"""DeepSpeed's partition methods 'uniform' and 'parameters', computed as it does (comparison)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

__all__ = []


def uniform(n: int, stages: int) -> list[int]:
    """Splits ``n`` layers into ``stages`` stages with equal layer counts.

    As DeepSpeed's ``partition_uniform`` does, the remainder ``n % stages`` goes one extra
    layer each to the first stages. Megatron-LM's default split agrees where ``stages``
    divides ``n`` and every layer is a decoder layer; it counts decoder layers only (the
    embedding joins the first stage, the output layer the last) and refuses a count that
    ``stages`` does not divide.

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
    """The balance DeepSpeed's ``partition_method="parameters"`` picks.

    DeepSpeed 0.19.8's ``PipelineModule._partition_layers`` counts each layer's trainable
    parameters (0 for a layer without any, or for a plain function) and hands them to
    ``deepspeed.runtime.utils.partition_balanced``. That is a dynamic program over the
    prefixes which keeps, per prefix and block count, the split of the smallest *spread*
    (largest block sum minus smallest), extending it block by block; the last start
    reaching the smallest spread wins. This function repeats it exactly — the same float
    arithmetic and the same choices — so the split is DeepSpeed's, not the split with the
    smallest largest block: ``[6, 5, 9, 3]`` into 3 stages is ``[1, 1, 2]`` (largest stage
    12, spread 7) where ``[2, 1, 1]`` holds 11 at most (spread 8).

    Scaling every weight by a power of two (bytes of one dtype for counts) changes no
    choice, so parameter bytes give DeepSpeed's split wherever all parameters share a dtype.

    Args:
        params: non-negative, finite parameter count (or bytes) of each layer, in order.
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
    if n == stages:  # DeepSpeed hands this case to partition_uniform: one layer each
        return [1] * n
    bounds = _spread_program(np.asarray(weights, dtype=np.float64), stages)
    return [b - a for a, b in itertools.pairwise(bounds)]


def _spread_program(weights: np.ndarray, m: int) -> list[int]:
    """``partition_balanced``'s boundaries ``[0, ..., n]``, computed as it computes them.

    For prefix ``i`` and ``j`` blocks DeepSpeed tries every start ``k`` of the last block in
    increasing order and takes it when its spread is ``<=`` the best so far, so the last
    start of least spread wins, with that start's largest and smallest block. The inner
    loop over ``k`` runs here as one array operation with the same float operations; a
    start with no ``j - 1``-block split has an infinite largest block, as there.
    """
    n = len(weights)
    dp_max = np.full((n + 1, m + 1), np.inf)
    dp_min = np.full((n + 1, m + 1), np.inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = 0.0
    for i in range(1, n + 1):
        last = prefix[i] - prefix[:i]  # the last block [k, i) for every start k < i
        for j in range(1, min(i, m) + 1):
            top = np.maximum(dp_max[:i, j - 1], last)
            bottom = np.minimum(dp_min[:i, j - 1], last)
            spread = top - bottom
            k = int(np.flatnonzero(spread == spread.min())[-1])
            dp_max[i, j], dp_min[i, j], position[i, j] = top[k], bottom[k], k
    bounds = [n]
    for j in range(m, 0, -1):
        bounds.append(int(position[bounds[-1], j]))
    return bounds[::-1]


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
