"""Calibration: measured executor overhead and link bandwidth, stored with the profile."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autopipe import plan
from autopipe.gpipe.executor_calibration import calibrate_executor, measure_overhead
from profiler.calibrate import measure_bandwidth, store_calibration
from tests.support.planning_cases import linear_profile


def test_bandwidth_of_a_cpu_copy():
    result = measure_bandwidth("cpu", "cpu", sizes=(1 << 16, 1 << 20), repeats=3)
    assert result["bandwidth"] > 1e6  # bytes/s; any machine copies more than 1 MB/s
    assert result["latency_s"] >= 0
    assert result["sizes"] == [1 << 16, 1 << 20] and len(result["times"]) == 2
    with pytest.raises(ValueError, match="at least one size"):
        measure_bandwidth(sizes=())


def test_overhead_of_gpipe():
    result = measure_overhead(("cpu", "cpu"), chunks=4, repeats=3, warmup=1)
    assert result["overhead_s"] >= 0
    assert len(result["stage_s"]) == 2 and all(t > 0 for t in result["stage_s"])
    # The step can only be explained by compute plus overhead.
    predicted = sum(result["stage_s"]) + 3 * max(result["stage_s"])
    assert result["step_s"] <= predicted + 5 * result["overhead_s"] + 1e-9


def test_overhead_under_autocast():
    result = measure_overhead(("cpu", "cpu"), chunks=2, repeats=1, warmup=0, autocast="bfloat16")
    assert result["overhead_s"] >= 0 and all(t > 0 for t in result["stage_s"])
    with pytest.raises(ValueError, match="autocast must be bfloat16 or float16"):
        measure_overhead(autocast="half")


def test_store_merges():
    profile = linear_profile([1.0] * 2)
    store_calibration(profile, overhead_s=1e-4)
    merged = store_calibration(profile, bandwidth=1e9, note="x")
    assert merged == {"overhead_s": 1e-4, "bandwidth": 1e9, "note": "x"}
    assert profile.meta["calibration"] is merged


def test_calibrate_stores_what_the_planner_uses(tmp_path):
    profile = linear_profile([1.0] * 4, output=[100] * 4)
    values = calibrate_executor(profile, ["cpu", "cpu"], repeats=2)
    assert set(values) >= {"overhead_s", "bandwidth", "latency_s", "devices"}
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = type(profile).load(path)
    assert loaded.meta["calibration"]["bandwidth"] == values["bandwidth"]
    result = plan(loaded, 2)
    assert result.devices[0].bandwidth == values["bandwidth"]
    assert result.stages[1].overhead == values["overhead_s"]


def test_profiler_calibrate_does_not_import_autopipe():
    code = (
        "import sys, profiler.calibrate\n"
        "assert not any(m.startswith('autopipe') for m in sys.modules), 'autopipe imported'\n"
        "assert 'torch' not in sys.modules, 'torch imported before use'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
