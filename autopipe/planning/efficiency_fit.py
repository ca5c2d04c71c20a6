"""The least-squares fit of the roofline's efficiencies to measured times (numpy only).

Each sample ``i`` (a layer, pass and batch size) has its compute seconds at the peak
``x_i = flops / peak``, its memory seconds ``y_i = traffic / bandwidth`` and its measured
seconds ``t_i``. With ``a = 1/η_f`` and ``b = 1/η_m`` the model is
``t̂_i = max(a·x_i, b·y_i) + o``, fitted to minimize ``Σ ((t̂_i − t_i) / t_i)²``.

The ``max`` only depends on which samples are compute-bound, and that is decided by one
number: sample ``i`` is compute-bound when ``x_i / y_i >= b / a``. Sorting the samples by
``x_i / y_i`` gives at most one partition per sample; within a partition the model is
linear in ``(a, b, o)``, solved by weighted least squares. The best partition's solution,
refined by re-partitioning until it is stable, is the fit (exact for times the model made).
"""

from __future__ import annotations

import numpy as np

__all__: list[str] = []

# Past this many distinct partitions, an evenly spread subset is tried; the refinement
# moves from the best of them to its neighbours.
_CANDIDATES = 512
_REFINEMENTS = 50


def _objective(params: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray) -> float:
    a, b, o = params
    return float(np.sum(((np.maximum(a * x, b * y) + o) / t - 1.0) ** 2))


def _linear(
    compute: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray, default: np.ndarray
) -> np.ndarray | None:
    """``(a, b, o)`` minimizing the relative error when ``compute`` marks the samples that
    are compute-bound; ``None`` when it needs a non-positive ``a`` or ``b``.

    A coefficient no sample determines (no compute-bound sample, say) keeps its default,
    lowered where it would make a sample change sides.
    """
    columns = np.stack([np.where(compute, x, 0.0), np.where(compute, 0.0, y), np.ones_like(t)])
    known = [k for k in range(2) if np.any(columns[k] > 0)]
    params = default.copy()
    for free in ([*known, 2], known):  # with the overhead, then without if it went negative
        design = (columns[free] / t).T
        solution, *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
        params[free] = solution
        if 2 not in free or solution[-1] >= 0:
            if 2 not in free:
                params[2] = 0.0
            break
    if any(params[k] <= 0 for k in known):
        return None
    for k in (0, 1):
        if k not in known:  # keep every sample on its side: a·x <= b·y (or b·y <= a·x)
            mine, other = (x, y) if k == 0 else (y, x)
            near = mine > 0
            if np.any(near):
                params[k] = min(params[k], float(np.min(params[1 - k] * other[near] / mine[near])))
    return params


def solve(
    x: np.ndarray, y: np.ndarray, t: np.ndarray, default: tuple[float, float, float]
) -> tuple[tuple[float, float, float], list[str]]:
    """The fitted ``(η_f, η_m, overhead)`` and notes on what the samples could not tell.

    Args:
        x: compute seconds of each sample at the peak FLOP/s.
        y: memory seconds of each sample at the peak bandwidth.
        t: measured seconds of each sample, all > 0.
        default: ``(η_f, η_m, overhead)`` for what the samples do not determine.
    """
    start = np.array([1.0 / default[0], 1.0 / default[1], default[2]])
    ratio = np.divide(x, y, out=np.full_like(x, np.inf), where=y > 0)
    steps = np.unique(ratio[(ratio > 0) & np.isfinite(ratio)])
    if len(steps) > _CANDIDATES:
        steps = steps[np.unique(np.linspace(0, len(steps) - 1, _CANDIDATES).round().astype(int))]
    best, score = start, _objective(start, x, y, t)
    for step in [*steps, np.inf]:
        params = _linear(ratio >= step, x, y, t, start)
        if params is not None and (found := _objective(params, x, y, t)) < score:
            best, score = params, found
    for _ in range(_REFINEMENTS):
        params = _linear(best[0] * x >= best[1] * y, x, y, t, start)
        if params is None or (found := _objective(params, x, y, t)) >= score:
            break
        best, score = params, found
    a, b, o = (float(v) for v in best)
    notes = []
    if not np.any((a * x >= b * y) & (x > 0)):
        notes.append(f"no pass is compute-bound: η_f is not measured, {1 / a:.3g} assumed")
    if not np.any(b * y > a * x):
        notes.append(f"no pass is memory-bound: η_m is not measured, {1 / b:.3g} assumed")
    return (1.0 / a, 1.0 / b, o), notes
