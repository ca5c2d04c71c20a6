"""Virtual stages: the closed-form interleaved step against the replayed schedule.

For random lognormal layer costs (mixed layers, and near-identical blocks), every split of L
layers into K·v stages is evaluated two ways: the closed form
``M·max_r C_r + (Σc − max_r C_r)/v`` (:func:`autopipe.planning.schedules.interleaving.step_time`)
and the replay of torch's own order of operations
(:mod:`autopipe.planning.schedules.schedule_replay`, what the planner uses). The tables give how far
the closed form is from the replay on the splits it picks, and how much slower (replayed) its best
split is than the replay's best.

Run: ``python -m benchmarks.planning.interleaved [--profiles N]``. Prints the table and saves
``benchmarks/results/interleaved.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts
from autopipe.planning.schedules.interleaving import step_times
from autopipe.planning.schedules.schedule_replay import makespans
from autopipe.planning.split.interleaved_balance import every_split

RESULTS = Path(__file__).resolve().parents[1] / "results"
# (K, v, M, schedule): M a multiple of interleaved 1F1B's rounds.
SHAPES = [
    (2, 2, 4, "1f1b"),
    (2, 2, 8, "1f1b"),
    (4, 2, 8, "1f1b"),
    (4, 2, 16, "1f1b"),
    (2, 3, 8, "1f1b"),
    (4, 2, 8, "gpipe"),
    (4, 2, 2, "1f1b"),
]
LAYERS = 14
# Spread of the layer costs (lognormal sigma): mixed layers, and near-identical blocks.
SPREADS = (1.0, 0.3)


def _costs(forward: np.ndarray) -> LayerCosts:
    """Layers of the given forward seconds, backward twice that, nothing in memory."""
    zeros = np.zeros(len(forward))
    return LayerCosts(
        names=[f"l{i}" for i in range(len(forward))],
        forward=forward,
        backward=2.0 * forward,
        saved=zeros,
        output=zeros,
        params=zeros,
        buffers=zeros,
        peak=zeros,
        input=0.0,
    )


def compare(forward: np.ndarray, k: int, v: int, m: int, schedule: str) -> dict[str, float]:
    """Both estimates over every split of one profile."""
    model = CostModel(
        _costs(forward),
        [DeviceSpec()] * (k * v),
        m,
        checkpoint="never",
        schedule=schedule,
        options=CostOptions(virtual_stages=v),
    )
    bounds = every_split(len(forward), k * v)
    parts = [model.stage_parts(s, bounds[:, s], bounds[:, s + 1]) for s in range(k * v)]
    f, b, t, codes = (np.stack([p[i] for p in parts], axis=1) for i in range(4))
    replayed = makespans(f, b, t, codes, k, m, schedule)
    closed = step_times(f + b + t, k, m)
    pick = int(np.argmin(closed))
    best = int(np.argmin(replayed))
    return {
        "closed_over_replay_at_its_pick": float(closed[pick] / replayed[pick]),
        "closed_over_replay_worst": float(np.min(closed / replayed)),
        "pick_over_best": float(replayed[pick] / replayed[best]),
    }


def run(profiles: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for sigma, (k, v, m, schedule) in itertools.product(SPREADS, SHAPES):
        start = time.perf_counter()
        found = [
            compare(rng.lognormal(sigma=sigma, size=LAYERS), k, v, m, schedule)
            for _ in range(profiles)
        ]
        at_pick = [r["closed_over_replay_at_its_pick"] for r in found]
        loss = [r["pick_over_best"] for r in found]
        row = {
            "sigma": sigma,
            "K": k,
            "v": v,
            "M": m,
            "schedule": schedule,
            "profiles": profiles,
            "closed_over_replay_at_pick_median": statistics.median(at_pick),
            "closed_over_replay_at_pick_worst": min(at_pick),
            "closed_over_replay_any_split_worst": min(r["closed_over_replay_worst"] for r in found),
            "closed_pick_slower_mean": statistics.fmean(loss),
            "closed_pick_slower_worst": max(loss),
            "closed_pick_not_best": sum(x > 1 + 1e-9 for x in loss) / len(loss),
        }
        rows.append(row)
        print(
            f"  sigma={sigma} K={k} v={v} M={m:>2} {schedule:5}: closed/replay at its pick "
            f"{row['closed_over_replay_at_pick_median']:.3f} (worst "
            f"{row['closed_over_replay_at_pick_worst']:.3f}); its pick is "
            f"{row['closed_pick_slower_mean']:.3f}x the best on average, worst "
            f"{row['closed_pick_slower_worst']:.3f} ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
        )
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Virtual stages: closed-form step time against the replayed schedule",
        "",
        f"Random lognormal layer costs (sigma: their spread; backward = 2 x forward, free "
        f"transfers), {LAYERS} layers, every split into K·v stages evaluated by the closed form "
        "M·max_r C_r + (Σc − max_r C_r)/v and by the replay of torch's order of operations "
        "(what the planner now minimizes). Ratios below 1 mean the closed form is too low.",
        "",
        "| sigma | K | v | M | schedule | profiles | closed / replay at its best split: median "
        "| worst | worst over all splits | its best split, replayed / replay's best: mean "
        "| worst | share not the best |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['sigma']} | {r['K']} | {r['v']} | {r['M']} | {r['schedule']} | {r['profiles']} "
            f"| {r['closed_over_replay_at_pick_median']:.3f} "
            f"| {r['closed_over_replay_at_pick_worst']:.3f} "
            f"| {r['closed_over_replay_any_split_worst']:.3f} "
            f"| {r['closed_pick_slower_mean']:.3f} | {r['closed_pick_slower_worst']:.3f} "
            f"| {r['closed_pick_not_best']:.0%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=100, help="random profiles per shape")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where to save the results")
    args = parser.parse_args(argv)
    print(f"comparing {len(SHAPES)} shapes x {args.profiles} profiles", file=sys.stderr)
    rows = run(args.profiles)
    text = render(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interleaved.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "interleaved.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
