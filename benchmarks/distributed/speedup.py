"""Speed-up of DistributedPipeline on two CPU processes over one, measured and predicted.

The model is 16 blocks of Linear(W, W) + GELU, batch B, M=8 micro-batches, MSE loss. Two
ranks (gloo, one thread each) run :class:`autopipe.distributed.DistributedPipeline` with
the 1F1B and GPipe schedules. Contenders, each timed over BURST back-to-back steps:

* pipeline: ``DistributedPipeline.step`` (the slower rank's time counts), for 1F1B, GPipe,
  interleaved 1F1B with two virtual stages per rank (four stages) and zero bubble (the
  last two predicted by replaying their order, :mod:`autopipe.planning.schedules.schedule_replay`);
* hand-made: a minimal 1F1B written with plain ``send``/``recv`` on the same stage modules,
  which shows what pipelining costs on this host whatever the implementation;
* baseline: one process with one thread (rank 0 alone; rank 1 waits) running the same
  micro-batches: forward, loss / M, backward.

Each rank is bound to its own CPU (``init_distributed(bind_cpus=True)``; ``--no-bind``
lets them float): unbound, the kernel now and then queues a rank's gloo thread behind the
other rank's compute and an activation arrives milliseconds late.

Rounds run every contender once, so load changes on the machine hit all of them; medians
are reported, with the CPUs other processes kept busy meanwhile ("other load": results
with other load are not meaningful on a 2-CPU host). The ideal speed-up of K balanced
stages is K·M/(M+K−1) (1.78 for K=2, M=8). The planner's prediction comes from rank 0's
one-thread profile: the plan's step time for the pipeline, the one-stage plan's for the
baseline. Results go to benchmarks/results/distributed_speedup.{json,md}.

Micro-batches of B/8 = 8 rows leave each Linear bound by reading its weights, and two
processes on one host then slow each other down through the shared memory system; at 64
rows they compute almost undisturbed. The default configurations cover both.

Usage: python -m benchmarks.distributed.speedup [--repeats 20] [--configs 512:64 1024:64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe.distributed import DistributedPipeline  # noqa: E402
from autopipe.distributed.calibration import calibrate_ranks, slowest_seconds  # noqa: E402
from autopipe.planning.planner import evaluate  # noqa: E402
from benchmarks.processes import (  # noqa: E402
    MALLOC,
    init_rank,
    rerun_with_stable_malloc,
    spawn_ranks,
)
from profiler.profile import Profile  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCKS, CHUNKS, WORLD = 16, 8, 2
# (width W, batch B) pairs timed by default.
CONFIGS = [(512, 64), (1024, 64), (512, 512)]
BURST = 5  # steps timed back to back
# Contender name: (schedule, virtual stages per rank).
SCHEDULES = {
    "1f1b": ("1f1b", 1),
    "gpipe": ("gpipe", 1),
    "1f1b interleaved x2": ("1f1b", 2),
    "zero bubble": ("zb", 1),
}


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(BLOCKS)]
    )


def baseline_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for xb, yb in zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS)):
        (nn.functional.mse_loss(model(xb), yb) / CHUNKS).backward()


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (every process), from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def handmade_step(stage: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
    """1F1B for two ranks with plain send/recv: what a schedule costs at least on this host."""
    micro = x.tensor_split(CHUNKS)
    if rank == 0:
        outputs: list[Any] = []
        sends = []
        for i in range(CHUNKS + 2):
            if i >= 2:  # one backward, then the next forward
                grad = torch.empty_like(outputs[i - 2])
                dist.recv(grad, 1)
                outputs[i - 2].backward(grad)
                outputs[i - 2] = None
            if i < CHUNKS:
                outputs.append(stage(micro[i]))
                sends.append(dist.isend(outputs[-1].detach(), 1))
        for send in sends:
            if send is not None:
                send.wait()
        return
    for i, target in enumerate(y.tensor_split(CHUNKS)):
        act = torch.empty(micro[i].shape[0], x.shape[1])
        dist.recv(act, 0)
        act.requires_grad_()
        (nn.functional.mse_loss(stage(act), target) / CHUNKS).backward()
        dist.send(act.grad, 0)  # type: ignore[arg-type]


def calibrate(
    profile: Profile, model: nn.Sequential, x: torch.Tensor, schedule: str = "1f1b"
) -> Profile:
    """A calibrated copy of the profile (:func:`autopipe.distributed.calibration.calibrate_ranks`).

    The pipeline runs with both ranks computing, which on one host slows each down; the
    one-process baseline runs alone. The calibration measures both, and the planner gives
    the one-device plan the scales of a rank alone. The runner's overhead is measured for
    one and for two stages per rank (``schedule`` with virtual stages).
    """
    calibrated = Profile.from_dict(profile.to_dict())
    calibrate_ranks(
        calibrated, model=model, sample=x, repeats=10, virtual_stages=2, schedule=schedule
    )
    return calibrated


def worker(
    rank: int, workdir: Path, width: int, batch: int, warmup: int, repeats: int, bind: bool
) -> None:
    init_rank(workdir, rank, WORLD, minutes=5, bind=bind)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    base = make_model(width)
    profile: Profile | None = None
    calibrated: Profile | None = None
    out: dict[str, Any] = {}
    for label, (schedule, virtual) in SCHEDULES.items():
        pipe = DistributedPipeline(
            make_model(width), x, loss_fn=nn.functional.mse_loss, chunks=CHUNKS,
            schedule=schedule, profile=profile, virtual_stages=virtual, checkpoint="never",
        )  # fmt: skip
        profile = Profile.from_dict(pipe.plan.profile)
        if calibrated is None:
            calibrated = calibrate(profile, base, x)
            handmade = partial(handmade_step, pipe.module, rank, x, y)  # on the 2-stage split
        contenders: dict[str, Callable[[], Any]] = {
            "pipeline": partial(pipe.step, x, y),
            "handmade": handmade,
            "baseline": lambda: baseline_step(base, x, y) if rank == 0 else None,
        }
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for i in range(warmup + repeats):
            if i == warmup:  # other processes' CPU use while timing, to flag a busy machine
                busy, own, wall = busy_cpu_seconds(), time.process_time(), time.perf_counter()
            for name, step in contenders.items():
                # BURST back-to-back steps, as in training; the slower rank's time counts.
                took = slowest_seconds(lambda f=step: [f() for _ in range(BURST)]) / BURST
                if i >= warmup:
                    times[name].append(took)
        ours = torch.tensor([time.process_time() - own], dtype=torch.float64)
        dist.all_reduce(ours)
        foreign = (busy_cpu_seconds() - busy - ours.item()) / (time.perf_counter() - wall)
        out[label] = {name: statistics.median(ts) for name, ts in times.items()}
        options = {"chunks": CHUNKS, "checkpoint": "never", "schedule": schedule}
        out[label].update(
            foreign_cpus=max(foreign, 0.0),
            balance=pipe.plan.balance,
            predicted=pipe.plan.step_time,
            predicted_baseline=evaluate(profile, [BLOCKS], **options).step_time,
            calibrated=evaluate(
                calibrated, pipe.plan.balance, virtual_stages=virtual, **options
            ).step_time,
            calibrated_baseline=evaluate(calibrated, [BLOCKS], **options).step_time,
            calibration=calibrated.meta["calibration"],
        )
    if rank == 0:
        (workdir / "result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run(width: int, batch: int, warmup: int, repeats: int, bind: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "benchmarks.distributed.speedup", "--worker"]
        options = [
            *("--width", str(width), "--batch", str(batch)),
            *("--warmup", str(warmup), "--repeats", str(repeats)),
            *([] if bind else ["--no-bind"]),
        ]
        return spawn_ranks(lambda r: [*command, str(r), tmp, *options], WORLD, Path(tmp))


def rows_of(result: dict[str, Any], width: int, batch: int) -> list[dict[str, Any]]:
    ideal = WORLD * CHUNKS / (CHUNKS + WORLD - 1)
    rows = []
    for schedule, r in result.items():
        speedup = r["baseline"] / r["pipeline"]
        rows.append(
            {
                "schedule": schedule,
                "balance": r["balance"],
                "baseline_ms": r["baseline"] * 1e3,
                "pipeline_ms": r["pipeline"] * 1e3,
                "handmade_ms": r["handmade"] * 1e3,
                "handmade_speedup": r["baseline"] / r["handmade"],
                "speedup": speedup,
                "ideal": ideal,
                "of_ideal": speedup / ideal,
                "predicted_ms": r["predicted"] * 1e3,
                "predicted_over_measured": r["predicted"] / r["pipeline"],
                "predicted_baseline_ms": r["predicted_baseline"] * 1e3,
                "predicted_baseline_over_measured": r["predicted_baseline"] / r["baseline"],
                "calibrated_ms": r["calibrated"] * 1e3,
                "calibrated_over_measured": r["calibrated"] / r["pipeline"],
                "calibrated_baseline_over_measured": r["calibrated_baseline"] / r["baseline"],
                "width": width,
                "batch": batch,
                "foreign_cpus": r["foreign_cpus"],
            }
        )
    return rows


COLUMNS = [
    ("W", "width", "{}"),
    ("batch", "batch", "{}"),
    ("schedule", "schedule", "{}"),
    ("balance", "balance", "{}"),
    ("1 process ms", "baseline_ms", "{:.1f}"),
    ("2 ranks ms", "pipeline_ms", "{:.1f}"),
    ("speed-up", "speedup", "{:.2f}"),
    ("ideal", "ideal", "{:.2f}"),
    ("of ideal", "of_ideal", "{:.0%}"),
    ("hand-made 1F1B ms", "handmade_ms", "{:.1f}"),
    ("its speed-up", "handmade_speedup", "{:.2f}"),
    ("predicted ms", "predicted_ms", "{:.1f}"),
    ("predicted/measured", "predicted_over_measured", "{:.2f}"),
    ("predicted 1-process ms", "predicted_baseline_ms", "{:.1f}"),
    ("predicted/measured (1 process)", "predicted_baseline_over_measured", "{:.2f}"),
    ("calibrated ms", "calibrated_ms", "{:.1f}"),
    ("calibrated/measured", "calibrated_over_measured", "{:.2f}"),
    ("calibrated/measured (1 process)", "calibrated_baseline_over_measured", "{:.2f}"),
    ("other load (CPUs)", "foreign_cpus", "{:.2f}"),
]


def config(text: str) -> tuple[int, int]:
    """``W:B`` on the command line: width and batch."""
    try:
        width, batch = (int(v) for v in text.split(":"))
    except ValueError:
        message = f"expected WIDTH:BATCH, e.g. 512:64, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    return width, batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument(
        "--configs", nargs="+", type=config, default=CONFIGS, metavar="W:B",
        help="width:batch pairs (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--no-bind", action="store_true", help="let the ranks float over all CPUs (not bound)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("RANK", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank, workdir = int(args.worker[0]), Path(args.worker[1])
        worker(rank, workdir, args.width, args.batch, args.warmup, args.repeats, not args.no_bind)
        return
    rerun_with_stable_malloc("benchmarks.distributed.speedup")
    print("  ".join(title for title, _, _ in COLUMNS))
    rows = []
    for width, batch in args.configs:
        for row in rows_of(
            run(width, batch, args.warmup, args.repeats, not args.no_bind), width, batch
        ):
            rows.append(row)
            print("  ".join(fmt.format(row[key]).rjust(len(t)) for t, key, fmt in COLUMNS))
    model = f"{BLOCKS} x (Linear(W, W) + GELU), batch B"
    meta = {
        "model": model,
        "chunks": CHUNKS,
        "ranks": WORLD,
        "backend": "gloo",
        "threads_per_process": 1,
        "bound_cpus": not args.no_bind,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "malloc": MALLOC,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "rows": rows}, indent=2)
    (RESULTS / "distributed_speedup.json").write_text(text + "\n")
    lines = [
        "# DistributedPipeline speed-up on the CPU",
        "",
        f"{model}, M={CHUNKS}, {WORLD} ranks on gloo with one thread each, against one process "
        f"with one thread on the same micro-batches; median of {args.repeats} rounds of "
        f"{BURST} back-to-back steps per contender after {args.warmup} warm-up rounds; torch "
        f"{torch.__version__}, {os.cpu_count()} CPUs.",
        "",
        f"ideal = K·M/(M+K−1) for K={WORLD}. hand-made 1F1B: the same stages driven by a "
        "minimal send/recv 1F1B loop, the floor of what pipelining costs on this host. "
        "predicted: the planner's step time from rank 0's one-thread profile "
        "(checkpoint='never'; identical blocks share their median timings). calibrated: the "
        "same after `calibrate_ranks` measured the gloo link, the runner's overhead and the "
        "compute scales with both ranks busy (the 1-process baseline uses the scales of one "
        "process alone). other load: CPUs kept busy by other processes while timing (0 on a "
        "quiet machine). glibc malloc keeps freed memory (benchmarks/processes.py). "
        + (
            "Each rank is bound to its own CPU (autopipe.distributed.cpu_binding; the baseline "
            "runs on "
            "rank 0's)."
            if not args.no_bind
            else "The ranks float over all CPUs (--no-bind)."
        ),
        "",
        "| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
        "|" + "---:|" * len(COLUMNS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |")
    (RESULTS / "distributed_speedup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
