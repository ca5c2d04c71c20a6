"""The estimates benchmark end to end on one small model (--quick), and its report."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.planning import estimates
from benchmarks.planning.estimates_report import held, render


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """One quick run on BERT (three inputs: GPipe gets them as one tuple)."""
    threads = torch.get_num_threads()
    out = tmp_path_factory.mktemp("estimates")
    try:
        assert estimates.main(["--quick", "--models", "bert", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    yield out, json.loads((out / "estimates.json").read_text())


def test_writes_the_three_files(quick_run: tuple[Path, dict[str, Any]]) -> None:
    out, results = quick_run
    assert (out / "estimates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "estimates.md").read_text()
    assert report == render(results)
    assert "## Summary" in report and "## bert" in report
    assert results["mode"] == "quick" and results["repeats"] == estimates.QUICK_REPEATS


def test_the_device_is_the_measured_cpu(quick_run: tuple[Path, dict[str, Any]]) -> None:
    device = quick_run[1]["device"]
    assert device["key"] == "host"
    assert device["figures"]["peak_flops"]["float32"] > 0
    assert device["figures"]["memory_bandwidth"] > 0


def test_fit_and_unit_errors_agree(quick_run: tuple[Path, dict[str, Any]]) -> None:
    (model,) = quick_run[1]["models"]
    assert model["model"] == "bert" and model["units"] == len(model["layers"])
    fit = model["fit"]
    assert fit["efficiency"]["compute"] > 0 and fit["efficiency"]["memory"] > 0
    # The benchmark's per-unit errors of the fitted estimate are the fit's own.
    errors = [u["fitted_error"] for u in model["layers"] if u["fitted_error"] is not None]
    assert statistics.median(errors) == pytest.approx(fit["median_error"])
    assert max(errors) == pytest.approx(fit["max_error"])
    assert model["unit_errors"]["fitted"]["max"] == pytest.approx(fit["max_error"])
    for unit in model["layers"]:
        assert unit["measured"] > 0 and unit["fitted"] > 0 and unit["default"] > 0


def test_rows_per_stage_count_and_source(quick_run: tuple[Path, dict[str, Any]]) -> None:
    (model,) = quick_run[1]["models"]
    rows = model["rows"]
    assert [(r["stages"], r["source"]) for r in rows] == [
        (k, s) for k in estimates.STAGES for s in estimates.SOURCES
    ]
    splits = {tuple(s["balance"]): s for s in model["splits"]}
    assert len(splits) == len(model["splits"])  # each distinct split measured once
    for row in rows:
        assert sum(row["balance"]) == model["units"] and len(row["balance"]) == row["stages"]
        split = splits[tuple(row["balance"])]
        assert row["step"] == split["step"]
        assert row["step"]["repeats"] == model["repeats"] == estimates.QUICK_REPEATS
        # Per round the slowest stage, so its median is at least every stage's median.
        assert row["bottleneck"] == split["bottleneck"]
        assert row["bottleneck"]["median"] >= max(row["stage_times"])
        assert len(row["stage_times"]) == row["stages"]
        assert row["bottleneck"]["repeats"] == model["stage_rounds"]
        if row["same_as_measured"]:
            assert row["step_ratio"] == row["bottleneck_ratio"] == row["predicted_ratio"] == 1.0
        for key in ("step_ratio", "bottleneck_ratio"):
            spread = row[f"{key}_spread"]
            assert spread["q1"] <= row[key] == spread["median"] <= spread["q3"]
        assert row["step_ratio"] > 0 and row["bottleneck_ratio"] > 0
        assert row["predicted_step"] > 0 and row["measured_profile_step"] > 0


def test_goal_and_unknown_models() -> None:
    assert held(1.05, 0.05) and held(0.8, 0.05) and not held(1.06, 0.05)
    with pytest.raises(SystemExit):
        estimates.main(["--models", "nosuch"])
