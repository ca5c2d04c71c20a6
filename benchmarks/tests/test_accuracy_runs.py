"""Tests of combining accuracy-benchmark runs and of its report (no timing)."""

from __future__ import annotations

import pytest

from benchmarks.accuracy.report import summary, write_report
from benchmarks.accuracy.runs import combine


def _row(chunks: int, predicted: float, measured: float, schedule: str = "gpipe") -> dict:
    return {
        "stages": 2,
        "data_parallel": 1,
        "chunks": chunks,
        "checkpoint": "never",
        "schedule": schedule,
        "balance": [2, 2],
        "predicted_s": predicted,
        "measured_s": measured,
        "time_ratio": predicted / measured,
        "predicted_memory": [10e6, 20e6],
        "measured_memory": [10e6, 20e6],
        "measured_activations": [1, 2],
        "memory_ratio": [1.0, 1.0],
    }


def _result(rows: list[dict]) -> dict:
    return {
        "m": {
            "calibration": {"overhead_s": 1e-5, "fixed_scale": 1.0, "compute_scale": 1.0},
            "device_name": "cpu",
            "one_device": rows,
        }
    }


def test_medians_per_configuration_in_the_first_runs_order() -> None:
    runs = [
        _result([_row(1, 1.0, 1.0), _row(2, 2.0, 2.0)]),
        _result([_row(2, 2.2, 2.0), _row(1, 1.0, 1.2), _row(4, 9.0, 9.0)]),
        _result([_row(1, 1.0, 1.1)]),
    ]
    rows = combine(runs)["m"]["one_device"]
    assert [r["chunks"] for r in rows] == [1, 2]  # the first run's configurations
    assert rows[0]["measured_s"] == pytest.approx(1.1)
    assert rows[0]["time_ratio"] == pytest.approx(1.0 / 1.1)
    assert rows[0]["runs_time_ratio"] == pytest.approx([1.0, 1.0 / 1.2, 1.0 / 1.1])
    assert rows[1]["predicted_s"] == pytest.approx(2.1)
    assert combine(runs[:1]) is runs[0]


def test_summary_and_report() -> None:
    rows = [_row(1, 1.1, 1.0), _row(2, 1.9, 2.0), _row(4, 3.0, 3.0)]
    s = summary(rows)
    assert s["worst_time_error"] == pytest.approx(0.1)
    assert s["first_over_fastest"] == pytest.approx(1.0)
    meta = {
        "device": "cpu",
        "cpus": 2,
        "torch": "x",
        "python": "3",
        "repeats": 5,
        "load": (1.0, 1.0, 1.0),
        "runs": 3,
    }
    text = write_report(meta, combine([_result(rows)] * 3))
    assert "Each of 3 independent runs" in text and "| 1 | 2×1 | 1 | never | gpipe |" in text
