"""``partition`` at 10⁶ layers against one numpy cumsum of the same costs, side by side.

A cumsum is the least any exact balancer over prefix sums must do, so the ratio says how
much the split costs beyond reading its input, and it stays meaningful on a noisy machine:
each round times the yardstick and ``partition`` back to back, and the ratio is taken
round by round. Costs come as a numpy array and as a Python list (which ``partition`` and
the cumsum must both convert first).

Run: ``python -m benchmarks.planning.partition_speed [--layers N] [--stages K] [--rounds R]``.
Prints a table and saves ``benchmarks/results/partition_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from autopipe import partition

RESULTS = Path(__file__).resolve().parents[1] / "results"


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure(layers: int, stages: int, rounds: int) -> list[dict[str, Any]]:
    """Per input kind, ``partition`` and cumsum seconds and their round-by-round ratio.

    Args:
        layers: how many lognormal layer costs.
        stages: K.
        rounds: paired rounds (one warm-up round before them is not counted).

    Returns:
        One row per input kind (``array``, ``list``): min, median and max of each figure.
    """
    costs = np.random.default_rng(0).lognormal(size=layers)
    rows = []
    for kind, given in (("array", costs), ("list", costs.tolist())):
        split, base, ratio = [], [], []
        for i in range(rounds + 1):
            b = _seconds(lambda g=given: np.cumsum(g))
            s = _seconds(lambda g=given: partition(g, stages))
            if i:  # the first round warms caches and allocators
                split.append(s)
                base.append(b)
                ratio.append(s / b)
        rows.append(
            {
                "input": kind,
                "layers": layers,
                "stages": stages,
                "partition_seconds": _spread(split),
                "cumsum_seconds": _spread(base),
                "ratio": _spread(ratio),
            }
        )
    return rows


def _markdown(results: dict[str, Any]) -> str:
    lines = [
        "# `partition` against one numpy cumsum of the same costs",
        "",
        f"Machine: {results['machine']}; load average before the run {results['load']}.",
        f"{results['rounds']} paired rounds; min / median / max.",
        "",
        "| input | layers | K | partition (ms) | cumsum (ms) | partition / cumsum |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        p, c, q = r["partition_seconds"], r["cumsum_seconds"], r["ratio"]
        lines.append(
            f"| {r['input']} | {r['layers']:,} | {r['stages']} "
            f"| {p['min'] * 1e3:.1f} / {p['median'] * 1e3:.1f} / {p['max'] * 1e3:.1f} "
            f"| {c['min'] * 1e3:.1f} / {c['median'] * 1e3:.1f} / {c['max'] * 1e3:.1f} "
            f"| {q['min']:.1f} / {q['median']:.1f} / {q['max']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1_000_000)
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    results = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, numpy {np.__version__}",
        "load": load,
        "rounds": args.rounds,
        "rows": measure(args.layers, args.stages, args.rounds),
    }
    report = _markdown(results)
    if not args.no_save:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "partition_speed.json").write_text(json.dumps(results, indent=1))
        (RESULTS / "partition_speed.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
