"""Calibration on the ranks: links, all-reduce, runner overhead and compute scales."""

from __future__ import annotations

from typing import Any

import pytest


def test_ranks_calibrate_links_and_runner_alike(equal_run: Any) -> None:
    _, results = equal_run
    found = [r["calibration"] for r in results]
    values = found[0]["values"]
    assert all(f["values"] == values for f in found)  # every rank plans with the same figures
    assert values["latency_s"] >= 0 and values["bandwidth"] > 0
    assert values["allreduce_bandwidth"] > 0 and values["overhead_s"] >= 0
    assert values["virtual_overhead_s"] >= 0  # torch's runtime for two stages per rank
    assert values["compute_scale"] > 0 and values["fixed_scale"] > 0
    assert values["alone_compute_scale"] > 0 and values["alone_fixed_scale"] > 0
    # The planner charges the measured all-reduce: 2·(D−1)/D · params / bandwidth.
    expected = found[0]["params"] / values["allreduce_bandwidth"]
    assert found[0]["allreduce"] == pytest.approx(expected)
