"""Per-micro-batch overhead of GPipe on the CPU against running the same micro-batches by hand.

The model is 16 blocks of Linear(W, W) + GELU, balance [8, 8] over ['cpu', 'cpu'],
``checkpoint='never'``, batch 64. Contenders, timed forward + backward:

* floor: the plain model on each micro-batch by hand, forward then backward;
* fill_drain: the plain model by hand in GPipe's order (every forward, then one backward),
  which separates what the schedule costs from what the implementation adds;
* gpipe: autopipe's GPipe; torchgpipe's too when it is importable.

Repeats are interleaved (each round runs every contender once, in a shuffled order) so load
changes on the machine hit every contender alike; medians are reported. The run keeps
freed memory in the process (benchmarks/processes.py), for every contender alike.
Results go to benchmarks/results/gpipe_overhead.{json,md}; with ``--system-malloc`` (glibc's
defaults, which return freed blocks to the OS) to gpipe_overhead_system_malloc.{json,md}.

Usage: python -m benchmarks.gpipe.overhead [--repeats 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autopipe import GPipe
from benchmarks.processes import MALLOC, rerun_with_stable_malloc

RESULTS = Path(__file__).resolve().parents[1] / "results"
BATCH = 64
BLOCKS = 16
BALANCE = [8, 8]


def make_model(width: int) -> nn.Sequential:
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(BLOCKS)]
    )


def floor_step(model: nn.Sequential, x: torch.Tensor, chunks: int) -> None:
    for mb in x.tensor_split(chunks):
        model(mb).sum().backward()


def fill_drain_step(model: nn.Sequential, x: torch.Tensor, chunks: int) -> None:
    torch.cat([model(mb) for mb in x.tensor_split(chunks)]).sum().backward()


def pipe_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def load_torchgpipe() -> Any:
    try:
        from torchgpipe import GPipe as TorchGPipe
    except Exception:
        return None
    return TorchGPipe


def torchgpipe_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchgpipe")
    except PackageNotFoundError:
        return "unknown"


def measure(width: int, chunks: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = make_model(width)
    x = torch.randn(BATCH, width)
    plain, by_hand = copy.deepcopy(base), copy.deepcopy(base)
    ours = GPipe(
        copy.deepcopy(base), BALANCE, devices=["cpu", "cpu"], chunks=chunks, checkpoint="never"
    )
    contenders: dict[str, Callable[[], None]] = {
        "floor": lambda: floor_step(plain, x, chunks),
        "fill_drain": lambda: fill_drain_step(by_hand, x, chunks),
        "gpipe": lambda: pipe_step(ours, x),
    }
    theirs_cls = load_torchgpipe()
    if theirs_cls is not None:
        options = {"devices": ["cpu", "cpu"], "chunks": chunks, "checkpoint": "never"}
        theirs = theirs_cls(copy.deepcopy(base), BALANCE, **options)
        contenders["torchgpipe"] = lambda: pipe_step(theirs, x)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(3):  # warm-up: allocator, worker start, autograd caches
        for fn in contenders.values():
            fn()
    order = list(contenders)
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        # A new order each round: whoever runs right after another contender inherits its
        # cache state, so no contender should always follow the same one.
        shuffle(order)
        for name in order:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    ours.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    micro = min(chunks, BATCH)
    return {
        "width": width,
        "chunks": chunks,
        "floor_ms": med["floor"] * 1e3,
        "fill_drain_ms": med["fill_drain"] * 1e3,
        "gpipe_ms": med["gpipe"] * 1e3,
        "ratio": med["gpipe"] / med["floor"],
        "overhead_us_per_microbatch": (med["gpipe"] - med["floor"]) / micro * 1e6,
        "fill_drain_ratio": med["fill_drain"] / med["floor"],
        "impl_overhead_us_per_microbatch": (med["gpipe"] - med["fill_drain"]) / micro * 1e6,
        "torchgpipe_ms": med["torchgpipe"] * 1e3 if "torchgpipe" in med else None,
        "torchgpipe_ratio": med["torchgpipe"] / med["floor"] if "torchgpipe" in med else None,
        "torchgpipe_us_per_microbatch": (med["torchgpipe"] - med["floor"]) / micro * 1e6
        if "torchgpipe" in med
        else None,
    }


COLUMNS = [
    ("W", "width", "{}"),
    ("chunks", "chunks", "{}"),
    ("floor ms", "floor_ms", "{:.2f}"),
    ("fill-drain ms", "fill_drain_ms", "{:.2f}"),
    ("GPipe ms", "gpipe_ms", "{:.2f}"),
    ("GPipe/floor", "ratio", "{:.3f}"),
    ("µs/mb vs floor", "overhead_us_per_microbatch", "{:.0f}"),
    ("fill-drain/floor", "fill_drain_ratio", "{:.3f}"),
    ("µs/mb vs fill-drain", "impl_overhead_us_per_microbatch", "{:.0f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--system-malloc", action="store_true", help="keep glibc's defaults")
    args = parser.parse_args()
    if not args.system_malloc:
        rerun_with_stable_malloc("benchmarks.gpipe.overhead")
    name = "gpipe_overhead_system_malloc" if args.system_malloc else "gpipe_overhead"
    torch.set_num_threads(args.threads)  # applies to GPipe's workers too
    has_torchgpipe = load_torchgpipe() is not None
    theirs = [
        ("torchgpipe ms", "torchgpipe_ms", "{:.2f}"),
        ("torchgpipe/floor", "torchgpipe_ratio", "{:.3f}"),
        ("torchgpipe µs/mb vs floor", "torchgpipe_us_per_microbatch", "{:.0f}"),
    ]
    columns = COLUMNS + (theirs if has_torchgpipe else [])
    print("  ".join(title for title, _, _ in columns))
    rows = []
    for width in args.widths:
        for chunks in args.chunks:
            row = measure(width, chunks, args.repeats)
            rows.append(row)
            print("  ".join(fmt.format(row[key]).rjust(len(t)) for t, key, fmt in columns))
    meta = {
        "model": f"{BLOCKS} x (Linear(W, W) + GELU), batch {BATCH}, balance {BALANCE}",
        "devices": ["cpu", "cpu"],
        "checkpoint": "never",
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torchgpipe": torchgpipe_version() if has_torchgpipe else None,
        "malloc": "glibc defaults" if args.system_malloc else MALLOC,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# GPipe overhead on the CPU",
        "",
        f"{meta['model']}, devices ['cpu', 'cpu'], checkpoint='never', "
        f"torch.set_num_threads({args.threads}), median of {args.repeats} interleaved repeats, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; "
        + (
            "glibc malloc with its defaults (freed blocks go back to the OS)."
            if args.system_malloc
            else "glibc malloc keeps freed memory (benchmarks/processes.py)."
        ),
        "",
        "floor: the plain model on each micro-batch by hand (forward, backward). fill-drain: the "
        "plain model by hand in GPipe's order (all forwards, one backward). µs/mb: extra time "
        "per micro-batch."
        + (
            f" torchgpipe {meta['torchgpipe']}: its GPipe on the same model, balance, devices, "
            "chunks and checkpoint, timed in the same rounds."
            if has_torchgpipe
            else ""
        ),
        "",
        "| " + " | ".join(title for title, _, _ in columns) + " |",
        "|" + "---:|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in columns) + " |")
    if not has_torchgpipe:
        lines += ["", "torchgpipe was not importable, so it was not timed."]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
