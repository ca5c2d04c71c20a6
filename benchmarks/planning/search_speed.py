"""How long ``autopipe.search`` takes on random 100- and 1,000-layer profiles, N = 8 and 64.

Each profile has lognormal layer times with a per-micro-batch intercept (so the number of
micro-batches matters), lognormal parameter sizes, and either equal boundaries (like a
transformer) or boundaries of 1, 2 or 4 units (like a CNN). Devices get no memory limit, or
50% or 15% of the bytes all parameters with Adam state need; links run at 20 GB/s and the
gradient all-reduce at 10 GB/s. Reported: median wall time of the search (fits included),
the configurations searched and how many each tier of the branch and bound handled.

Run: ``python -m benchmarks.planning.search_speed [--repeats 3]``; results go to
``benchmarks/results/search_speed.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autopipe.planning.configuration.config_search import search
from profiler.profile import LayerProfile, Profile

RESULTS = Path(__file__).resolve().parents[1] / "results"
SIZES = [4, 8]  # micro-batch sizes the synthetic profile was "measured" at
WIDTH = 4096  # bytes of one boundary unit per sample


def random_profile(rng: np.random.Generator, layers: int, varied: bool) -> Profile:
    """A synthetic profile for batch 256 (see the module docstring)."""
    out = []
    for i in range(layers):
        slope = rng.lognormal(-9, 0.7)  # forward seconds per sample
        intercept = slope * rng.uniform(0.5, 4)  # fixed seconds per micro-batch
        boundary = WIDTH * (int(rng.choice([1, 2, 4])) if varied else 1)
        saved = boundary * int(rng.integers(2, 8))
        out.append(
            LayerProfile(
                name=f"layer{i}",
                kind="Block",
                forward=[intercept + slope * s for s in SIZES],
                backward=[2 * (intercept + slope * s) for s in SIZES],
                saved=[saved * s for s in SIZES],
                output=[boundary * s for s in SIZES],
                param_bytes=int(rng.lognormal(13, 1.0)),
                peak=[boundary * s for s in SIZES],
            )
        )
    return Profile(layers=out, batch_sizes=SIZES, input=[WIDTH * s for s in SIZES], batch_size=256)


def run_case(layers: int, devices: int, varied: bool, share: float | None, repeats: int) -> dict:
    profile = random_profile(np.random.default_rng(layers + devices), layers, varied)
    # Parameters, gradients and two Adam states.
    state = 4 * sum(layer.param_bytes for layer in profile.layers)
    memory = None if share is None else int(share * state)
    times = []
    for _ in range(repeats):
        fresh = Profile.from_dict(profile.to_dict())  # fits are part of the cost
        start = time.perf_counter()
        plans = search(
            fresh, devices, memory=memory, bandwidth=20e9, allreduce_bandwidth=10e9, top=10
        )
        times.append(time.perf_counter() - start)
    best = plans[0]
    summary = best.notes[0]
    counts = [int(word) for word in summary.replace(":", " ").split() if word.isdigit()]
    return {
        "layers": layers,
        "devices": devices,
        "boundaries": "varied" if varied else "equal",
        "memory_share": share,
        "seconds": statistics.median(times),
        "configurations": counts[0],
        "relaxed": counts[2],
        "intervals": counts[3],
        "programs": counts[4],
        "best": f"K={best.num_stages} D={best.data_parallel} M={best.chunks} "
        f"{best.checkpoint} {best.schedule}",
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# `autopipe.search` speed",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (load average "
        f"{os.getloadavg()[0]:.1f} at the end), Python {platform.python_version()}. Median "
        "wall time of a search over every K·D <= N, M and checkpoint mode, both schedules, "
        "top 10, fitting the profile included (see benchmarks/planning/search_speed.py).",
        "",
        "| layers | N | boundaries | memory | time | configurations | relaxed | interval "
        "| DP | best |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        share = "unlimited" if r["memory_share"] is None else f"{r['memory_share']:.0%}"
        lines.append(
            f"| {r['layers']:,} | {r['devices']} | {r['boundaries']} | {share} | "
            f"{r['seconds']:.2f} s | {r['configurations']:,} | {r['relaxed']} | "
            f"{r['intervals']} | {r['programs']} | {r['best']} |"
        )
    lines += [
        "",
        "*relaxed*: configurations bounded by the relaxed min-max partition; *interval*: "
        "solved by the interval solver; *DP*: by the dynamic program. The others were "
        "pruned by their O(1) bound. Memory is a share of what all parameters with Adam "
        "state need on one device.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = []
    for layers in (100, 1000):
        for devices in (8, 64):
            for varied in (False, True):
                for share in (None, 0.5, 0.15):
                    row = run_case(layers, devices, varied, share, args.repeats)
                    rows.append(row)
                    print(
                        f"L={layers:>5} N={devices:>2} {row['boundaries']:>6} "
                        f"memory={share}: {row['seconds']:.2f} s, {row['best']}",
                        file=sys.stderr,
                    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "search_speed.json").write_text(json.dumps(rows, indent=2) + "\n")
    (RESULTS / "search_speed.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
