"""Tests of the measured matmul peaks and memory bandwidth (profiler.roofline)."""

from __future__ import annotations

import math

import pytest
import torch

from profiler.roofline import measure_peaks


def test_the_peaks_and_bandwidth_are_positive_finite_numbers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    found = measure_peaks("cpu", ("float32", "bfloat16"), seconds=0.3)
    assert set(found) == {"device", "name", "peak_flops", "memory_bandwidth", "memory"}
    assert found["device"] == "cpu" and isinstance(found["name"], str) and found["name"]
    assert set(found["peak_flops"]) == {"float32", "bfloat16"}
    for value in [*found["peak_flops"].values(), found["memory_bandwidth"], found["memory"]]:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0
    assert isinstance(found["memory"], int)
    assert capsys.readouterr().out == ""


def test_the_tf32_setting_is_left_as_it_was() -> None:
    before = torch.backends.cuda.matmul.allow_tf32
    measure_peaks("cpu", ("float32",), seconds=0.05)
    assert torch.backends.cuda.matmul.allow_tf32 == before


@pytest.mark.parametrize(
    "dtypes, message",
    [(("int8",), "cannot measure a 'int8' peak; choose float32"), (("tf32",), "CUDA tensor-core")],
)
def test_bad_dtypes_are_refused_before_measuring(dtypes: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        measure_peaks("cpu", dtypes)


def test_a_bad_time_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="seconds is 0; it must be a number > 0"):
        measure_peaks(seconds=0)
