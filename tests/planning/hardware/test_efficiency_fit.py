"""The least-squares fit of the roofline's efficiencies (autopipe.planning.hardware.efficiency_fit)
on samples the model made, on noisy ones, and on samples that cannot tell a coefficient."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.hardware.efficiency_fit import solve

DEFAULT = (0.5, 0.5, 0.0)


def _samples(seed: int, count: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Compute and memory seconds at the peaks, their ratio spread evenly in log from 1/20
    to 20, so that either side bounds some samples under each efficiency tested."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(1e-6, 1e-3, count)
    y = x * np.exp(rng.uniform(np.log(0.05), np.log(20.0), count))
    return x, y


def _times(x: np.ndarray, y: np.ndarray, compute: float, memory: float, overhead: float):
    return np.maximum(x / compute, y / memory) + overhead


def _log_error(fit: tuple[float, float, float], x, y, t) -> float:
    return float(np.sum(np.log(_times(x, y, fit[0], fit[1], fit[2]) / t) ** 2))


@pytest.mark.parametrize(
    "truth", [(0.43, 0.81, 7e-6), (0.9, 0.2, 0.0), (0.05, 0.6, 1e-4), (0.6, 0.6, 2e-6)]
)
def test_times_the_model_made_are_fitted_exactly(truth: tuple[float, float, float]) -> None:
    for seed in range(4):
        x, y = _samples(seed)
        fit, notes = solve(x, y, _times(x, y, *truth), DEFAULT)
        assert fit[:2] == pytest.approx(truth[:2], rel=1e-9)
        assert fit[2] == pytest.approx(truth[2], rel=1e-6, abs=1e-15)
        assert notes == []


def _noisy(truth: tuple[float, float, float]) -> list[tuple[np.ndarray, ...]]:
    """Four sets of samples whose times are the model's, each off by a log-normal factor
    (σ = 0.1)."""
    rng = np.random.default_rng(7)
    cases = []
    for seed in range(4):
        x, y = _samples(seed)
        cases.append((x, y, _times(x, y, *truth) * np.exp(rng.normal(0.0, 0.1, len(x)))))
    return cases


NOISY_TRUTH = (0.4, 0.7, 5e-6)


def test_noisy_times_get_no_worse_fit_than_the_truth() -> None:
    for x, y, t in _noisy(NOISY_TRUTH):
        fit, notes = solve(x, y, t, DEFAULT)
        assert _log_error(fit, x, y, t) <= _log_error(NOISY_TRUTH, x, y, t)
        assert fit == pytest.approx(NOISY_TRUTH, rel=0.1, abs=2e-5) and notes == []


def test_noisy_fit_is_a_local_optimum_of_the_log_error() -> None:
    for x, y, t in _noisy(NOISY_TRUTH):
        fit, _ = solve(x, y, t, DEFAULT)
        best = _log_error(fit, x, y, t)
        for k in range(3):
            for factor in (0.99, 1.01):
                nearby = list(fit)
                nearby[k] *= factor
                assert best <= _log_error(tuple(nearby), x, y, t) * (1 + 1e-9)


def test_without_a_compute_bound_sample_the_compute_efficiency_is_assumed() -> None:
    x, y = _samples(1)
    x = x * 1e-6  # far below every memory time
    fit, notes = solve(x, y, _times(x, y, 0.5, 0.8, 0.0), DEFAULT)
    assert fit[1] == pytest.approx(0.8, rel=1e-9)
    assert fit[0] <= DEFAULT[0]  # the default, lowered where it would flip a sample
    assert len(notes) == 1 and notes[0].startswith("no pass is compute-bound: η_f is not")


def test_without_memory_traffic_the_memory_efficiency_is_assumed() -> None:
    x, _ = _samples(2)
    y = np.zeros_like(x)
    fit, notes = solve(x, y, x / 0.3 + 1e-6, DEFAULT)
    assert fit[0] == pytest.approx(0.3, rel=1e-9) and fit[1] == DEFAULT[1]
    assert fit[2] == pytest.approx(1e-6, rel=1e-6)
    assert notes == ["no pass is memory-bound: η_m is not measured, 0.5 assumed"]


def test_the_overhead_is_never_negative() -> None:
    x, y = _samples(3)
    # Times below the roofline's by a constant: the best fit would subtract it.
    t = _times(x, y, 0.5, 0.5, 0.0) - 0.5 * float(x.min())
    fit, _ = solve(x, y, t, DEFAULT)
    assert fit[2] >= 0.0
    assert fit[0] > 0 and fit[1] > 0
