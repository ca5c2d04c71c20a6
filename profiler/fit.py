"""Per-layer figures against the micro-batch size: a least-squares line, and segments."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["fit_linear", "segments"]


def fit_linear(batches: Sequence[int], values: Sequence[float]) -> tuple[float, float]:
    """Fits ``value = a + b * batch`` with ``a, b >= 0``.

    Non-negative coefficients keep predictions sensible outside the measured range: a
    layer never gets cheaper with a larger batch and never costs less than nothing. A
    single measurement is read as pure per-sample cost.
    """
    if len(batches) != len(values) or not batches:
        raise ValueError("need one value per batch size and at least one batch size")
    x = np.asarray(batches, dtype=float)
    y = np.asarray(values, dtype=float)
    if len(set(batches)) == 1:
        return 0.0, float(max(y.mean(), 0.0) / x[0])
    design = np.stack([np.ones_like(x), x], axis=1)
    # Relative weighting: small batches matter as much as large ones.
    scale = np.maximum(np.abs(y), 1e-30)
    # Imported here: scipy takes longer to load than the rest of the planner together.
    from scipy.optimize import nnls

    coef, _ = nnls(design / scale[:, None], y / scale)
    return float(coef[0]), float(coef[1])


def segments(
    sizes: Sequence[float] | NDArray[np.float64], values: NDArray[np.float64], size: float
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The ``(a, b)`` of the line through each row's measurements around ``size``.

    ``values`` holds one row per figure (last axis: one value per measured size, sizes
    ascending). Between two measured sizes a figure is interpolated linearly; beyond them
    the nearest segment goes on, never falling with the size, and below the smallest size
    never below zero at size 0 (then proportional to the size). With one measured size the
    figure is read as proportional to the size.
    """
    x = np.asarray(sizes, dtype=float)
    if len(x) == 1:
        return np.zeros(values.shape[:-1]), values[..., 0] / x[0]
    j = int(np.clip(np.searchsorted(x, size) - 1, 0, len(x) - 2))
    slope = (values[..., j + 1] - values[..., j]) / (x[j + 1] - x[j])
    if x[0] <= size <= x[-1]:
        return values[..., j] - slope * x[j], slope
    end = 0 if size < x[0] else len(x) - 1
    slope = np.maximum(slope, 0.0)
    intercept = values[..., end] - slope * x[end]
    if end == 0:  # through the origin rather than below zero
        low = intercept < 0
        slope = np.where(low, values[..., 0] / x[0], slope)
        intercept = np.where(low, 0.0, intercept)
    return intercept, slope
