"""The least-squares fit of the roofline's efficiencies to measured times (numpy only).

Each sample ``i`` (a layer, pass and batch size) has its compute seconds at the peak
``x_i = flops / peak``, its memory seconds ``y_i = traffic / bandwidth`` and its measured
seconds ``t_i``. With ``a = 1/η_f`` and ``b = 1/η_m`` the model is
``t̂_i = max(a·x_i, b·y_i) + o``, fitted to minimize ``Σ log(t̂_i / t_i)²``: the relative
error, symmetric (an estimate half the measurement weighs as much as one twice it, where
``(t̂ − t) / t`` would let underestimates off lightly and bias the fit low).

The ``max`` only depends on which samples are compute-bound, and that is decided by one
number: sample ``i`` is compute-bound when ``x_i / y_i >= b / a``. Sorting the samples by
``x_i / y_i`` gives at most one partition per sample; within a partition the model is
linear in ``(a, b, o)``, and weighted least squares of ``(t̂ − t) / t`` gives a first
solution. The best few are refined by Gauss-Newton steps on the log error, re-partitioning
after each step, and with the overhead held at its bound (0) where a free step would take
it below. The fit is exact for times the model made.
"""

from __future__ import annotations

import numpy as np

__all__: list[str] = []

# Past this many distinct partitions, an evenly spread subset is tried; the refinement
# moves from the best of them to their neighbours.
_CANDIDATES = 512
_REFINED = 8
_STEPS = 60


def _estimate(params: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    a, b, o = params
    return np.maximum(a * x, b * y) + o


def _objective(params: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray) -> float:
    # A sample the model gives 0 s (no work, no overhead) is as wrong as can be.
    ratio = np.maximum(_estimate(params, x, y), 1e-300) / t
    return float(np.sum(np.log(ratio) ** 2))


def _columns(compute: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The model's derivatives by ``(a, b, o)`` when ``compute`` marks compute-bound samples."""
    return np.stack([np.where(compute, x, 0.0), np.where(compute, 0.0, y), np.ones_like(x)])


def _bounded(params: np.ndarray, known: list[int], x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A coefficient no sample determines (no compute-bound sample, say) keeps its
    default, lowered where it would make a sample change sides."""
    for k in (0, 1):
        if k not in known:  # keep every sample on its side: a·x <= b·y (or b·y <= a·x)
            mine, other = (x, y) if k == 0 else (y, x)
            near = mine > 0
            if np.any(near):
                params[k] = min(params[k], float(np.min(params[1 - k] * other[near] / mine[near])))
    return params


def _linear(
    compute: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray, default: np.ndarray
) -> np.ndarray | None:
    """``(a, b, o)`` minimizing ``Σ ((t̂ − t) / t)²`` within a partition; ``None`` when it
    needs a non-positive ``a`` or ``b``."""
    columns = _columns(compute, x, y)
    known = [k for k in range(2) if np.any(columns[k] > 0)]
    params = default.copy()
    for free in ([*known, 2], known):  # with the overhead, then without if it went negative
        solution, *_ = np.linalg.lstsq((columns[free] / t).T, np.ones_like(t), rcond=None)
        params[free] = solution
        if 2 not in free or solution[-1] >= 0:
            if 2 not in free:
                params[2] = 0.0
            break
    if any(params[k] <= 0 for k in known):
        return None
    return _bounded(params, known, x, y)


def _directions(
    params: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray
) -> list[tuple[list[int], np.ndarray]]:
    """The Gauss-Newton steps from ``params``: with every coefficient free, and, where that
    step would take the overhead below its bound (0), with the overhead held there.

    A step solved with the overhead free and then clipped to 0 is not a descent direction
    for the others: it spends part of the fit on an overhead that cannot follow, so the
    line search finds nothing and the refinement would stop short of the constrained
    optimum."""
    estimate = np.maximum(_estimate(params, x, y), 1e-300)
    columns = _columns(params[0] * x >= params[1] * y, x, y)
    residual = -np.log(estimate / t)
    found = []
    free = [k for k in range(3) if np.any(columns[k] > 0)]
    step, *_ = np.linalg.lstsq((columns[free] / estimate).T, residual, rcond=None)
    found.append((free, step))
    if 2 in free and params[2] + step[-1] < 0:
        held = free[:-1]
        step, *_ = np.linalg.lstsq((columns[held] / estimate).T, residual, rcond=None)
        found.append((held, step))
    return found


def _refine(
    params: np.ndarray, x: np.ndarray, y: np.ndarray, t: np.ndarray
) -> tuple[np.ndarray, float]:
    """Gauss-Newton steps on the log error from ``params``, halved until they improve."""
    score = _objective(params, x, y, t)
    for _ in range(_STEPS):
        best, best_score = params, score
        for free, step in _directions(params, x, y, t):
            size = 1.0
            while size > 1e-6:
                trial = params.copy()
                trial[free] += size * step
                trial[2] = max(trial[2], 0.0)
                if trial[0] > 0 and trial[1] > 0:
                    found = _objective(trial, x, y, t)
                    if found < best_score:
                        best, best_score = trial, found
                        break
                size /= 2
        improved = best_score < score * (1 - 1e-12) and score - best_score > 1e-30
        params, score = best, best_score
        if not improved:
            break
    return params, score


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
    found = [(_objective(start, x, y, t), 0, start)]
    for i, step in enumerate([*steps, np.inf], start=1):
        params = _linear(ratio >= step, x, y, t, start)
        if params is not None:
            found.append((_objective(params, x, y, t), i, params))
    found.sort(key=lambda item: item[:2])
    best, score = found[0][2], found[0][0]
    for _, _, params in found[:_REFINED]:
        params, refined = _refine(params, x, y, t)
        if refined < score:
            best, score = params, refined
    a, b, o = (float(v) for v in best)
    notes = []
    if not np.any((a * x >= b * y) & (x > 0)):
        notes.append(f"no pass is compute-bound: η_f is not measured, {1 / a:.3g} assumed")
    if not np.any(b * y > a * x):
        notes.append(f"no pass is memory-bound: η_m is not measured, {1 / b:.3g} assumed")
    return (1.0 / a, 1.0 / b, o), notes
