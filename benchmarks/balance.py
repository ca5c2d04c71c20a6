"""Balance quality on the model zoo: predicted vs measured stage times of every strategy.

Run: ``python -m benchmarks.balance [--quick] [--models a,b]``. Each zoo model is cut into
units, profiled once on this machine's CPU (one thread), and planned with every strategy
for K = 2, 4, 8 stages. Every planned stage is then run alone on its micro-batch inputs
(forward + backward, plus the share of re-computation forwards the stage checkpoints), so the
real bottleneck of each plan is measured, not only predicted. A last table puts GPipe's
Table 2 (normalized throughput against K and M) in our terms, as predictions from the CPU
profiles. Saves ``benchmarks/results/balance.{json,md}`` and ``balance_<model>.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from autopipe import Plan, PlanningError, plan
from autopipe.model_file import as_sequential
from autopipe.timeline import checkpointed
from benchmarks.models import ZOO
from profiler import profile_model
from profiler.profile import Profile

RESULTS = Path(__file__).parent / "results"
STRATEGIES = ("uniform", "parameters", "blockpartition", "optimal")
MEMORY_LABEL = "optimal (memory)"
LABELS = (*STRATEGIES, MEMORY_LABEL)
MEMORY_FRACTION = 0.6
STAGES = (2, 4, 8)
CHUNKS = 4
TABLE2_CHUNKS = (1, 4, 32)
# GPipe (Huang et al., 2019), Table 2: normalized throughput on TPUs, M = 1 / 4 / 32.
GPIPE_TABLE2 = {
    "AmoebaNet-D": {2: (1.0, 1.07, 1.21), 4: (1.13, 1.26, 1.84), 8: (1.38, 1.72, 3.48)},
    "Transformer-48": {2: (1.0, 1.7, 1.8), 4: (1.07, 3.2, 3.4), 8: (1.3, 4.8, 6.3)},
}


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def _run(units: list[nn.Module], args: tuple[Any, ...]) -> tuple[Any, ...]:
    for unit in units:
        args = _as_tuple(unit(*args))
    return args


class StageTimer:
    """Measures stages (slices of the unit Sequential) alone on one micro-batch."""

    def __init__(self, seq: nn.Sequential, sample: tuple[Tensor, ...], repeats: int) -> None:
        self.units = list(seq)
        self.sample = sample
        self.repeats = repeats
        self._inputs: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._times: dict[tuple[int, int, int, bool], float] = {}

    def _input(self, start: int, micro: int) -> tuple[Any, ...]:
        key = (start, micro)
        if key not in self._inputs:
            with torch.no_grad():
                self._inputs[key] = _run(self.units[:start], tuple(t[:micro] for t in self.sample))
        return self._inputs[key]

    def stage(self, start: int, stop: int, micro: int, recompute: float) -> float:
        """Median seconds of forward + backward, plus ``recompute`` x a no-grad forward."""
        train = self._median(start, stop, micro, grad=True)
        if recompute <= 0:
            return train
        return train + recompute * self._median(start, stop, micro, grad=False)

    def _median(self, start: int, stop: int, micro: int, grad: bool) -> float:
        key = (start, stop, micro, grad)
        if key in self._times:
            return self._times[key]
        units = self.units[start:stop]
        inputs = self._input(start, micro)
        params = [p for u in units for p in u.parameters()]

        def once() -> float:
            args = tuple(
                t.detach().clone().requires_grad_(grad and t.is_floating_point())
                if isinstance(t, Tensor)
                else t
                for t in inputs
            )
            for p in params:
                p.grad = None
            begin = time.perf_counter()
            if not grad:
                with torch.no_grad():
                    _run(units, args)
                return time.perf_counter() - begin
            outputs = [o for o in _run(units, args) if isinstance(o, Tensor) and o.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
            return time.perf_counter() - begin

        once()  # warm-up
        seconds = statistics.median(once() for _ in range(self.repeats))
        for p in params:
            p.grad = None
        self._times[key] = seconds
        return seconds


def _recomputed(p: Plan, stage: int) -> float:
    """Share of micro-batches whose forward ``stage`` re-computes in backward."""
    return sum(checkpointed(p, i, stage) for i in range(p.chunks)) / p.chunks


def _plans(profile: Profile, stages: int) -> tuple[dict[str, Plan | None], dict[str, float]]:
    """Plans of every strategy at ``stages``; ``None`` where it does not fit."""
    plans: dict[str, Plan | None] = {}
    seconds: dict[str, float] = {}
    for strategy in STRATEGIES:
        begin = time.perf_counter()
        plans[strategy] = plan(profile, stages, chunks=CHUNKS, strategy=strategy)
        seconds[strategy] = time.perf_counter() - begin
    best = plans["optimal"]
    assert best is not None
    cap = int(MEMORY_FRACTION * max(s.memory for s in best.stages))
    begin = time.perf_counter()
    try:
        plans[MEMORY_LABEL] = plan(profile, stages, chunks=CHUNKS, memory=cap)
    except PlanningError:
        plans[MEMORY_LABEL] = None
    seconds[MEMORY_LABEL] = time.perf_counter() - begin
    return plans, seconds


def bench_model(name: str, quick: bool) -> dict[str, Any]:
    """Profiles, plans and measures one zoo model."""
    module = ZOO[name]
    begin = time.perf_counter()
    seq, sample = as_sequential(module.model(), module.sample())
    flat = _as_tuple(sample)
    profile = profile_model(seq, sample, chunks=CHUNKS, repeats=2 if quick else 3, warmup=1)
    profile_seconds = time.perf_counter() - begin
    print(
        f"  {name}: {len(seq)} units, batch {profile.batch_size}, profiled in "
        f"{profile_seconds:.1f} s",
        file=sys.stderr,
    )
    timer = StageTimer(seq, flat, repeats=3 if quick else 5)
    rows: list[dict[str, Any]] = []
    planning: dict[int, dict[str, float]] = {}
    bars: dict[str, Plan] = {}
    for stages in STAGES:
        if stages > len(seq):
            continue
        plans, planning[stages] = _plans(profile, stages)
        measured: dict[str, list[float]] = {}
        for label, p in plans.items():
            if p is None:
                continue
            measured[label] = [
                timer.stage(s.start, s.stop, p.micro_batch, _recomputed(p, s.index))
                for s in p.stages
            ]
        best_measured = max(measured["optimal"])
        best = plans["optimal"]
        assert best is not None
        for label in LABELS:
            p = plans[label]
            row: dict[str, Any] = {"stages": stages, "strategy": label, "fits": p is not None}
            if p is not None:
                row.update(
                    balance=list(p.balance),
                    capacity=p.stages[0].capacity,
                    predicted_bottleneck=p.bottleneck,
                    predicted_step=p.step_time,
                    predicted_ratio=p.bottleneck / best.bottleneck,
                    max_stage_memory=max(s.memory for s in p.stages),
                    stage_memory=[s.memory for s in p.stages],
                    predicted_stage_times=[s.time for s in p.stages],
                    measured_stage_times=measured[label],
                    measured_bottleneck=max(measured[label]),
                    measured_ratio=max(measured[label]) / best_measured,
                )
            else:
                row["capacity"] = int(MEMORY_FRACTION * max(s.memory for s in best.stages))
            rows.append(row)
        if stages == 4:
            bars = {label: p for label, p in plans.items() if p is not None}
        print(f"    K={stages}: planned and measured", file=sys.stderr)
    picture = None
    if bars:
        from autopipe.timeline import draw_stage_bars

        path = RESULTS / f"balance_{name}.png"
        try:
            draw_stage_bars(bars, path)
            picture = path.name
        except ImportError:
            pass
    return {
        "model": name,
        "units": len(seq),
        "batch": profile.batch_size,
        "profile_seconds": profile_seconds,
        "planning_seconds": planning,
        "rows": rows,
        "table2": table2(profile, len(seq)),
        "picture": picture,
    }


def table2(profile: Profile, units: int) -> dict[str, dict[str, list[float | None]]]:
    """Predicted throughput(K, M) / throughput(K=2, M=1) of the uniform and optimal splits.

    The micro-batch is the profiled one (batch / 4); a step runs M of them.
    """
    micro = -(-profile.batch_size // CHUNKS)
    out: dict[str, dict[str, list[float | None]]] = {}
    for strategy in ("uniform", "optimal"):
        raw: dict[int, list[float | None]] = {}
        for stages in STAGES:
            raw[stages] = []
            for m in TABLE2_CHUNKS:
                if stages > units:
                    raw[stages].append(None)
                    continue
                p = plan(profile, stages, chunks=m, batch=m * micro, strategy=strategy)
                raw[stages].append(m * micro / p.step_time)
        base = raw[2][0]
        assert base is not None
        out[strategy] = {
            str(k): [None if v is None else v / base for v in values] for k, values in raw.items()
        }
    return out


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _markdown(results: dict[str, Any]) -> str:
    lines = ["# Balance on the model zoo: predicted and measured", ""]
    lines += [
        f"Machine: {results['machine']}; {results['mode']} run, one CPU thread. Each model is "
        f"profiled once (M={CHUNKS} micro-batches of its sample batch) and planned with "
        f"checkpointing `except_last`. *Measured* stage times run each planned stage alone "
        "on its micro-batch inputs: forward + backward from ones-like output gradients, plus "
        "a no-grad re-computation forward weighted by the share of micro-batches the stage "
        "checkpoints ((M-1)/M under `except_last`); medians of "
        f"{results['stage_repeats']} runs. Transfers are free on one CPU and not measured. "
        f"`{MEMORY_LABEL}` is the optimal plan under a per-device cap of "
        f"{MEMORY_FRACTION} x the largest stage memory of the unconstrained optimal plan.",
        "",
    ]
    lines += ["## Measured bottleneck / optimal's measured bottleneck, K=4", ""]
    lines += ["| model | " + " | ".join(LABELS) + " |", "|---" + "|---:" * len(LABELS) + "|"]
    for m in results["models"]:
        cells = []
        for label in LABELS:
            row = next((r for r in m["rows"] if r["stages"] == 4 and r["strategy"] == label), None)
            if row is None:
                cells.append("-")
            elif not row["fits"]:
                cells.append("does not fit")
            else:
                cells.append(f"{row['measured_ratio']:.3f}")
        lines.append(f"| {m['model']} | " + " | ".join(cells) + " |")
    lines += ["", "## Planning time per strategy (ms, per K)", ""]
    lines += [
        "| model | K | " + " | ".join(LABELS) + " |",
        "|---|---:" + "|---:" * len(LABELS) + "|",
    ]
    for m in results["models"]:
        for k, seconds in m["planning_seconds"].items():
            cells = [f"{seconds[label] * 1e3:.1f}" for label in LABELS]
            lines.append(f"| {m['model']} | {k} | " + " | ".join(cells) + " |")
    lines += ["", "## Every plan", ""]
    lines += [
        "| model | K | strategy | balance | predicted bottleneck | predicted step | "
        "max stage memory | measured bottleneck | predicted / optimal | measured / optimal |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results["models"]:
        for r in m["rows"]:
            head = f"| {m['model']} | {r['stages']} | {r['strategy']} |"
            if not r["fits"]:
                lines.append(f"{head} does not fit in {_fmt_bytes(r['capacity'])} | | | | | | |")
                continue
            lines.append(
                f"{head} {r['balance']} | {_fmt_time(r['predicted_bottleneck'])} | "
                f"{_fmt_time(r['predicted_step'])} | {_fmt_bytes(r['max_stage_memory'])} | "
                f"{_fmt_time(r['measured_bottleneck'])} | {r['predicted_ratio']:.3f} | "
                f"{r['measured_ratio']:.3f} |"
            )
    lines += ["", "## GPipe Table 2 in our terms: normalized throughput", ""]
    lines += [
        "**These are predictions from CPU profiles of tiny models, not TPU measurements.** "
        "Throughput(K, M) = M x micro-batch / predicted step time, with the micro-batch fixed "
        f"at the profiled one (batch / {CHUNKS}), normalized by the same split's K=2, M=1 "
        "value. GPipe's numbers are the paper's TPU measurements (Huang et al., 2019, "
        "Table 2).",
        "",
    ]
    header = "| model | split | " + " | ".join(
        f"K={k} M={m}" for k in STAGES for m in TABLE2_CHUNKS
    )
    lines += [header + " |", "|---|---" + "|---:" * (len(STAGES) * len(TABLE2_CHUNKS)) + "|"]
    for paper, table in GPIPE_TABLE2.items():
        cells = [f"{v:.2f}" for k in STAGES for v in table[k]]
        lines.append(f"| {paper} (GPipe, TPU) | paper | " + " | ".join(cells) + " |")
    for m in results["models"]:
        for split, table in m["table2"].items():
            cells = ["-" if v is None else f"{v:.2f}" for k in STAGES for v in table[str(k)]]
            lines.append(f"| {m['model']} | {split} | " + " | ".join(cells) + " |")
    pictures = [m["picture"] for m in results["models"] if m["picture"]]
    if pictures:
        lines += ["", "## Stage bars, K=4", ""]
        lines += [f"![{p}]({p})" for p in pictures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer profiling and timing runs")
    parser.add_argument(
        "--models", default=",".join(ZOO), help=f"comma-separated subset of {', '.join(ZOO)}"
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in ZOO]
    if unknown or not names:
        parser.error(f"unknown models {unknown}; choose from {', '.join(ZOO)}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    print("balance on the model zoo ...", file=sys.stderr)
    models = [bench_model(name, args.quick) for name in names]
    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''}, "
        f"Python {platform.python_version()}, torch {torch.__version__}",
        "mode": "quick" if args.quick else "full",
        "stage_repeats": 3 if args.quick else 5,
        "memory_fraction": MEMORY_FRACTION,
        "chunks": CHUNKS,
        "gpipe_table2": {k: {str(s): v for s, v in t.items()} for k, t in GPIPE_TABLE2.items()},
        "models": models,
    }
    (RESULTS / "balance.json").write_text(json.dumps(results, indent=1))
    report = _markdown(results)
    (RESULTS / "balance.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
