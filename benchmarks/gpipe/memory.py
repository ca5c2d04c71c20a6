"""Activation memory of GPipe per partition, per checkpoint mode, against GPipe's formula.

Counts the bytes autograd keeps for backward ("saved tensors"), de-duplicated by storage and
excluding parameters, with ``torch.autograd.graph.saved_tensors_hooks`` (GPipe carries the
hooks into its worker threads). A forward pre-hook on each partition attributes every saved
tensor to the partition that saved it.

* held: saved bytes between forward and backward.
* recompute: the largest saved bytes of one re-materialized micro-batch during backward.
* peak: what a partition needs at most. Backward runs the micro-batches in reverse, one at a
  time, so it is held + recompute with ``always``; with ``except_last`` the last micro-batch
  (kept in full) is released before the first recomputation, so it is
  max(held, held - last + recompute).

GPipe's formula for one partition of L/K layers with a mini-batch of N split into M
micro-batches: O(N · L/K) without re-materialization, O(N + L/K · N/M) with it. For this
model every layer (Linear + GELU) keeps two (N, W) float tensors, so the predictions are
exact: never = 2 · L/K · N · s, always = N · s + 2 · L/K · (N/M) · s with s = 4 W bytes.

Usage: python -m benchmarks.gpipe.memory [--width 256] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autopipe import GPipe

RESULTS = Path(__file__).resolve().parents[1] / "results"
LAYERS = 16
BALANCE = [8, 8]
MODES = ("never", "except_last", "always")


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(LAYERS)]
    )


class SavedBytes:
    """Saved-tensor bytes by (phase, partition, call), each storage counted once."""

    def __init__(self, pipe: GPipe) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in pipe.parameters()}
        self.records: dict[tuple[str, int, int], dict[int, int]] = defaultdict(dict)
        self.phase = "forward"
        self.local = threading.local()
        self.calls = 0
        for j, partition in enumerate(pipe.partitions):
            partition.register_forward_pre_hook(lambda _m, _a, j=j: self._enter(j))

    def _enter(self, partition: int) -> None:
        # Runs in the thread about to run the partition: a worker in forward, the autograd
        # engine's thread when a checkpointed partition is recomputed.
        self.calls += 1
        self.local.where = (partition, self.calls)

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in self.params:
            partition, call = self.local.where
            self.records[(self.phase, partition, call)][key] = storage.nbytes()
        return tensor

    def total(self, phase: str, partition: int) -> int:
        merged: dict[int, int] = {}
        for (p, j, _), storages in self.records.items():
            if p == phase and j == partition:
                merged.update(storages)
        return sum(merged.values())

    def calls_of(self, phase: str, partition: int) -> list[int]:
        """Bytes saved by each call of the partition, in call order."""
        return [
            sum(s.values())
            for (p, j, _), s in sorted(self.records.items(), key=lambda item: item[0][2])
            if p == phase and j == partition
        ]


def measure(width: int, batch: int, chunks: int, mode: str) -> list[dict[str, Any]]:
    devices = ["cpu"] * len(BALANCE)
    pipe = GPipe(make_model(width), BALANCE, devices=devices, chunks=chunks, checkpoint=mode)
    counter = SavedBytes(pipe)
    x = torch.randn(batch, width)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = pipe(x)
        counter.phase = "backward"
        out.sum().backward()
    pipe.close()
    s = 4 * width
    rows = []
    for j, layers in enumerate(BALANCE):
        held = counter.total("forward", j)
        recompute = max(counter.calls_of("backward", j), default=0)
        if mode == "always":
            peak = held + recompute
        elif mode == "except_last" and recompute:
            last = counter.calls_of("forward", j)[-1]
            peak = max(held, held - last + recompute)
        else:
            peak = held
        micro = batch // chunks
        formula = {
            "never": 2 * layers * batch * s,
            "always": batch * s + 2 * layers * micro * s,
            # all but the last micro-batch keep their input; the last keeps everything
            "except_last": (batch - micro) * s + 2 * layers * micro * s,
        }[mode]
        rows.append(
            {
                "mode": mode,
                "chunks": chunks,
                "partition": j,
                "held_bytes": held,
                "recompute_bytes": recompute,
                "peak_bytes": peak,
                "formula_bytes": formula,
            }
        )
    return rows


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    rows = [
        row
        for mode in MODES
        for chunks in args.chunks
        for row in measure(args.width, args.batch, chunks, mode)
    ]
    header = "| checkpoint | M | partition | held MiB | recompute MiB | peak MiB | formula MiB |"
    lines = [
        "# GPipe activation memory per partition",
        "",
        f"{LAYERS} x (Linear(W, W) + GELU), W={args.width}, N={args.batch}, balance {BALANCE} "
        "on CPU. Saved-for-backward bytes de-duplicated by storage, parameters excluded. "
        "peak: held plus the largest recomputed micro-batch (always), less the last "
        "micro-batch's activations released before it (except_last). formula (peak): "
        "2·L/K·N·s for never, N·s + 2·L/K·(N/M)·s for always, (N − N/M)·s + 2·L/K·(N/M)·s "
        "for except_last (s = 4W bytes per sample).",
        "",
        header,
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print(header)
    for r in rows:
        line = (
            f"| {r['mode']} | {r['chunks']} | {r['partition']} | {mib(r['held_bytes'])} | "
            f"{mib(r['recompute_bytes'])} | {mib(r['peak_bytes'])} | {mib(r['formula_bytes'])} |"
        )
        lines.append(line)
        print(line)
    meta = {"width": args.width, "batch": args.batch, "layers": LAYERS, "balance": BALANCE}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpipe_memory.json").write_text(
        json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n"
    )
    (RESULTS / "gpipe_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
