"""Activation memory of DistributedPipeline's ranks with and without re-materialization.

Two gloo ranks run 16 blocks of Linear(W, W) + GELU, batch B, M=8, split [8, 8], under
GPipe and 1F1B with ``checkpoint`` ``never``, ``except_last`` and ``always``. Each rank
measures the resident memory a training step adds on top of what stays between steps
(parameters, gradients): after a warm-up step, freed memory is handed back to the OS
(``malloc_trim``), the kernel's peak counter is reset (``/proc/self/clear_refs``), one step
runs, and the peak's excess over the resident size before it is the step's activation
memory (with whatever a step holds briefly). The plan's ``activation_memory`` of the
rank's stage is set beside it. Each configuration runs in fresh processes, so one
configuration's peak cannot hide another's.

Run: ``python -m benchmarks.distributed.memory [--width 256] [--batch 8192]``. Linux only.
Saves ``benchmarks/results/distributed_memory.{json,md}``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe.distributed import DistributedPipeline  # noqa: E402
from autopipe.planning.planner import evaluate  # noqa: E402
from benchmarks.processes import init_rank, spawn_ranks  # noqa: E402
from profiler.measure import profile_model  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCKS, CHUNKS, WORLD = 16, 8, 2
CONFIGS = [
    (schedule, mode)
    for schedule in ("gpipe", "1f1b")
    for mode in ("never", "except_last", "always")
]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _settle() -> int:
    """Hands freed memory back to the OS and resets the peak: the resident bytes now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks)


def worker(rank: int, workdir: Path, width: int, batch: int, schedule: str, mode: str) -> None:
    init_rank(workdir, rank, WORLD, minutes=5, bind=True)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    # A profile of a few rows gives the planner's per-row figures without a large peak.
    profile = profile_model(make_model(width), x[:32], chunks=4, warmup=0, repeats=1)
    options = {"chunks": CHUNKS, "schedule": schedule, "checkpoint": mode, "batch": batch}
    plan = evaluate(profile, [BLOCKS // 2] * 2, **options)
    pipe = DistributedPipeline(
        make_model(width),
        x,
        loss_fn=nn.functional.mse_loss,
        chunks=CHUNKS,
        schedule=schedule,
        plan=plan,
        checkpoint=mode,
    )
    pipe.step(x, y)  # allocates the gradients, which stay
    before = _settle()
    pipe.step(x, y)
    measured = _status("VmHWM") - before
    stage = plan.stages[rank]
    result = {"measured": measured, "predicted": stage.activation_memory, "mode": stage.checkpoint}
    (workdir / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    if rank == 0:
        ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(WORLD)]
        (workdir / "result.json").write_text(json.dumps({"ranks": ranks}))
    torch.distributed.destroy_process_group()


def render(rows: list[dict[str, Any]], width: int, batch: int) -> str:
    mib = 2.0**20
    lines = [
        "# DistributedPipeline: activation memory per rank, measured and planned",
        "",
        f"{BLOCKS} x (Linear({width}) + GELU), batch {batch}, M={CHUNKS}, split [8, 8] on "
        f"{WORLD} gloo ranks; torch {torch.__version__}. measured: the resident memory a "
        "training step adds at its peak over what stays between steps (after a warm-up step, "
        "freed memory trimmed and the peak counter reset); planned: the plan's activation "
        "memory of the rank's stage (saved activations and checkpointed stage inputs).",
        "",
        "| schedule | checkpoint | rank | measured MiB | planned MiB | measured / planned |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['schedule']} | {row['checkpoint']} | {row['rank']} "
            f"| {row['measured'] / mib:.1f} | {row['predicted'] / mib:.1f} "
            f"| {row['measured'] / row['predicted']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Narrow layers on many rows: activations, not weight-sized temporaries, dominate.
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, workdir, schedule, mode = args.worker
        worker(int(rank), Path(workdir), args.width, args.batch, schedule, mode)
        return
    rows = []
    size = ["--width", str(args.width), "--batch", str(args.batch)]
    command = [sys.executable, "-m", "benchmarks.distributed.memory", *size, "--worker"]
    for schedule, mode in CONFIGS:
        print(f"  {schedule}, checkpoint {mode}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            found = spawn_ranks(
                lambda r, t=tmp, s=schedule, m=mode: [*command, str(r), t, s, m], WORLD, Path(tmp)
            )
        for rank, result in enumerate(found["ranks"]):
            rows.append({"schedule": schedule, "checkpoint": mode, "rank": rank, **result})
    text = render(rows, args.width, args.batch)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"width": args.width, "batch": args.batch, "torch": torch.__version__}
    (args.out / "distributed_memory.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    (args.out / "distributed_memory.md").write_text(text)


if __name__ == "__main__":
    main()
