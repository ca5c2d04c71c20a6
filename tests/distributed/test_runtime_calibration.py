"""The runner's figures measured at construction when none are cached
(autopipe.distributed.runtime_calibration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.dist_workers import scenario_results


@pytest.mark.usefixtures("calibration_cache")
def test_calibrate_measures_once_and_keeps_it(tmp_path: Path) -> None:
    results = scenario_results("construction-calibration", 2, tmp_path, limit=180)
    first = results[0]
    # By default nothing is measured: no cache entry, no overhead in the plan.
    assert first["default"] == (0.0, None)
    overhead, entry = first["measured"]
    assert entry is not None and set(entry) >= {"overhead_s", "latency_s", "bandwidth"}
    assert overhead == entry["overhead_s"]  # rank 0 planned with what the ranks measured
    assert first["calibration"]["overhead_s"] == entry["overhead_s"]
    # The next pipeline finds the entry: nothing measured again, the same figures planned.
    assert first["again"] == (overhead, entry)
    # Every rank planned alike and refused alike.
    assert all(r["measured"][0] == overhead for r in results)
    assert all(r["error"] == "calibrate must be True or False, got 'yes'" for r in results)
