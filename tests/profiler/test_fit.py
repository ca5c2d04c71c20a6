"""Tests of the non-negative linear fit of a figure against the batch size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from profiler.fit import fit_linear


def test_exact_line_is_recovered() -> None:
    a, b = fit_linear([1, 2, 4, 8], [2 + 3 * x for x in (1, 2, 4, 8)])
    assert a == pytest.approx(2, rel=1e-6)
    assert b == pytest.approx(3, rel=1e-6)


def test_pure_per_sample_cost() -> None:
    a, b = fit_linear([4, 8], [40, 80])
    assert a == pytest.approx(0, abs=1e-9)
    assert b == pytest.approx(10)


def test_falling_values_give_no_negative_slope() -> None:
    a, b = fit_linear([1, 2], [5.0, 3.0])
    assert b == pytest.approx(0, abs=1e-12)
    assert 3.0 <= a <= 5.0


def test_single_batch_size_is_per_sample_cost() -> None:
    assert fit_linear([4], [8.0]) == (0.0, 2.0)
    assert fit_linear([4, 4], [6.0, 10.0]) == (0.0, 2.0)


def test_mismatched_or_empty_input_raises() -> None:
    with pytest.raises(ValueError):
        fit_linear([1, 2], [1.0])
    with pytest.raises(ValueError):
        fit_linear([], [])


@given(
    st.lists(st.integers(1, 1024), min_size=1, max_size=6, unique=True),
    st.floats(-1e3, 1e3),
    st.floats(-1e3, 1e3),
)
def test_coefficients_are_never_negative(batches: list[int], a: float, b: float) -> None:
    fa, fb = fit_linear(batches, [a + b * x for x in batches])
    assert fa >= 0 and fb >= 0
