"""Combines independent runs of benchmarks/accuracy/ranked_plans.py: per configuration, medians."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["combine"]


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    schedule = row["schedule"] if row["stages"] > 1 else "-"
    return (row["stages"], row["data_parallel"], row["chunks"], row["checkpoint"], schedule)


def _combine_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The first run's configurations in its order, each with the medians over the runs
    that ran it (every run profiles, calibrates and searches anew, so a later run may rank
    other configurations; those are left out)."""
    out = []
    for row in runs[0]:
        same = [r for rows in runs for r in rows if _key(r) == _key(row)]
        predicted = statistics.median(r["predicted_s"] for r in same)
        measured = statistics.median(r["measured_s"] for r in same)
        out.append(
            {
                **row,
                "predicted_s": predicted,
                "measured_s": measured,
                "time_ratio": predicted / measured,
                "runs_time_ratio": [r["time_ratio"] for r in same],
            }
        )
    return out


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result with the per-configuration medians of several runs' results."""
    if len(runs) == 1:
        return runs[0]
    combined: dict[str, Any] = {}
    for name, first in runs[0].items():
        result = dict(first)
        result["one_device"] = _combine_rows([run[name]["one_device"] for run in runs])
        if "two_devices" in first:
            two = dict(first["two_devices"])
            two["rows"] = _combine_rows([run[name]["two_devices"]["rows"] for run in runs])
            result["two_devices"] = two
        combined[name] = result
    return combined
