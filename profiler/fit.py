"""Least-squares fit of a per-layer figure against the micro-batch size."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

__all__ = ["fit_linear"]


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
    coef, _ = nnls(design / scale[:, None], y / scale)
    return float(coef[0]), float(coef[1])
