"""Interleaved schedules measured against both step-time estimates, on splits they disagree on.

Two gloo ranks (one thread each, bound to their own CPUs) run 16 identical blocks of
Linear(W, W) + GELU as four stages, two per rank, with interleaved 1F1B and looped BFS
(``schedule="gpipe"`` with virtual stages), M=8. Every split below gives each rank 8
blocks, so the closed form ``M·max_r C_r + (Σc − max_r C_r)/v`` predicts them all alike;
the replay of torch's order of operations (:mod:`autopipe.planning.schedules.schedule_replay`, what
the planner uses) does not: a heavy stage early in the pipeline starves the stages after it.
Both estimates come from the calibrated profile (``calibrate_ranks``: link, runner
overhead, compute scales with both ranks busy), and are set against the measured step
(median of rounds of back-to-back steps, every split once per round).

Run: ``python -m benchmarks.distributed.interleaved [--width 1024] [--batch 64]``. Saves
``benchmarks/results/interleaved_measured.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe.distributed import DistributedPipeline  # noqa: E402
from autopipe.distributed.calibration import measure_runner_overhead, slowest_seconds  # noqa: E402
from autopipe.planning.planner import evaluate  # noqa: E402
from autopipe.planning.schedules.interleaving import step_time as closed_form  # noqa: E402
from benchmarks.distributed.speedup import BLOCKS, CHUNKS, WORLD, calibrate, make_model  # noqa: E402
from benchmarks.processes import (  # noqa: E402
    MALLOC,
    init_rank,
    rerun_with_stable_malloc,
    spawn_ranks,
)
from profiler.calibrate import store_calibration  # noqa: E402
from profiler.profile import Profile  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
BURST = 3  # steps timed back to back
SPLITS = ([4, 4, 4, 4], [6, 2, 2, 6], [2, 6, 6, 2])
SCHEDULES = {"interleaved 1f1b": "1f1b", "looped bfs": "gpipe"}


def worker(rank: int, workdir: Path, width: int, batch: int, warmup: int, repeats: int) -> None:
    init_rank(workdir, rank, WORLD, minutes=10, bind=True)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    options: dict[str, Any] = {"loss_fn": nn.functional.mse_loss, "chunks": CHUNKS}
    first = DistributedPipeline(make_model(width), x, virtual_stages=2, **options)
    profile = Profile.from_dict(first.plan.profile)
    calibrated = calibrate(profile, make_model(width), x)
    del first
    pipes: dict[tuple[str, str], DistributedPipeline] = {}
    predictions: dict[tuple[str, str], dict[str, float]] = {}
    for label, schedule in SCHEDULES.items():
        # The runner's overhead with two stages per rank, under this schedule.
        found = calibrated.meta["calibration"]
        overhead = measure_runner_overhead(
            latency=found["latency_s"], virtual_stages=2, schedule=schedule
        )
        store_calibration(calibrated, virtual_overhead_s=overhead["overhead_s"])
        for split in SPLITS:
            plan_options = {"chunks": CHUNKS, "checkpoint": "never", "schedule": schedule}
            plan = evaluate(calibrated, split, virtual_stages=2, **plan_options)
            key = (label, str(split))
            pipes[key] = DistributedPipeline(
                make_model(width), x, schedule=schedule, plan=plan, virtual_stages=2, **options
            )
            predictions[key] = {
                "replay": plan.step_time,
                "closed": closed_form([s.time for s in plan.stages], WORLD, CHUNKS),
                "overhead": plan.stages[0].overhead,
            }
    times: dict[tuple[str, str], list[float]] = {key: [] for key in pipes}
    for i in range(warmup + repeats):
        for key, pipe in pipes.items():
            step = partial(pipe.step, x, y)
            took = slowest_seconds(lambda f=step: [f() for _ in range(BURST)]) / BURST
            if i >= warmup:
                times[key].append(took)
        if rank == 0:
            print(f"  round {i + 1}/{warmup + repeats}", file=sys.stderr, flush=True)
    if rank == 0:
        rows = [
            {
                "schedule": label,
                "split": split,
                "measured_ms": statistics.median(times[(label, split)]) * 1e3,
                "replay_ms": predictions[(label, split)]["replay"] * 1e3,
                "closed_ms": predictions[(label, split)]["closed"] * 1e3,
                "overhead_us": predictions[(label, split)]["overhead"] * 1e6,
            }
            for label, split in pipes
        ]
        (workdir / "result.json").write_text(json.dumps({"rows": rows}))
    torch.distributed.destroy_process_group()


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Interleaved schedules: measured against the replayed and the closed-form step",
        "",
        f"{BLOCKS} x (Linear({meta['width']}) + GELU), batch {meta['batch']}, M={CHUNKS}, "
        f"{WORLD} gloo ranks (one thread each, bound), two stages per rank; torch "
        f"{meta['torch']}, {meta['cpus']} CPUs; median of {meta['repeats']} rounds of "
        f"{BURST} back-to-back steps. Every split gives each rank 8 blocks, so the closed "
        "form M·max_r C_r + (Σc − max_r C_r)/v predicts them alike; the replay of torch's "
        "order of operations does not. Both from the calibrated profile, whose runner "
        "overhead per stage and micro-batch is measured with two stages per rank under each "
        "schedule (torch runs virtual stages on another runtime than one stage per rank).",
        "",
        "| schedule | split | measured ms | replayed ms | replayed / measured "
        "| closed form ms | closed / measured | measured / same schedule's [4, 4, 4, 4] "
        "| replayed ratio | closed ratio | runner overhead µs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    even = {r["schedule"]: r for r in rows if r["split"] == str(list(SPLITS[0]))}
    for r in rows:
        base = even[r["schedule"]]
        lines.append(
            f"| {r['schedule']} | {r['split']} | {r['measured_ms']:.1f} | {r['replay_ms']:.1f} "
            f"| {r['replay_ms'] / r['measured_ms']:.2f} | {r['closed_ms']:.1f} "
            f"| {r['closed_ms'] / r['measured_ms']:.2f} "
            f"| {r['measured_ms'] / base['measured_ms']:.2f} "
            f"| {r['replay_ms'] / base['replay_ms']:.2f} "
            f"| {r['closed_ms'] / base['closed_ms']:.2f} | {r['overhead_us']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def draw(rows: list[dict[str, Any]], path: Path) -> bool:
    """Each split's step relative to its schedule's even split: measured, replayed and
    closed-form side by side (``False`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    even = {r["schedule"]: r for r in rows if r["split"] == str(list(SPLITS[0]))}
    labels = [f"{r['schedule']}\n{r['split']}" for r in rows]
    series = {
        "measured": [r["measured_ms"] / even[r["schedule"]]["measured_ms"] for r in rows],
        "replayed (planner)": [r["replay_ms"] / even[r["schedule"]]["replay_ms"] for r in rows],
        "closed form": [r["closed_ms"] / even[r["schedule"]]["closed_ms"] for r in rows],
    }
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(rows))], values, width, label=name)
    ax.set_xticks([x + width for x in range(len(rows))], labels, fontsize=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("step / same schedule's even split")
    ax.set_title("Interleaved splits that give each rank the same work: who tells them apart")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", nargs=2, metavar=("RANK", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, workdir = int(args.worker[0]), Path(args.worker[1])
        worker(rank, workdir, args.width, args.batch, args.warmup, args.repeats)
        return
    rerun_with_stable_malloc("benchmarks.distributed.interleaved")
    options = [
        *("--width", str(args.width), "--batch", str(args.batch)),
        *("--warmup", str(args.warmup), "--repeats", str(args.repeats)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "benchmarks.distributed.interleaved", "--worker"]
        rows = spawn_ranks(lambda r: [*command, str(r), tmp, *options], WORLD, Path(tmp))["rows"]
    meta = {
        "width": args.width,
        "batch": args.batch,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "malloc": MALLOC,
    }
    text = render(rows, meta)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "interleaved_measured.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    (args.out / "interleaved_measured.md").write_text(text)
    if draw(rows, args.out / "interleaved_measured.png"):
        print(f"picture: {args.out / 'interleaved_measured.png'}", file=sys.stderr)


if __name__ == "__main__":
    main()
