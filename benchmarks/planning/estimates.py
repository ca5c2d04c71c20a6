"""Estimated layer times on this CPU against measured ones, and the splits planned from each.

Run: ``python -m benchmarks.planning.estimates [--quick] [--models a,b] [--out DIR]``. The
CPU is described as a catalog device by its measured peaks (``profiler.roofline``), one
torch thread. For each zoo model and the Hugging Face GPT-2 example (``hf-gpt2``, traced
into units):

1. a profile is measured (real times, with counted FLOPs and bytes) and estimated from
   its counts with the default efficiencies and with efficiencies fitted to it
   (``autopipe.planning.hardware.estimates``); the fit's error per layer is reported;
2. K = 2 and 4 stages are planned from the measured, the fitted and the default profile;
   every distinct split is measured end to end: whole training steps (forward, loss,
   backward) of the GPipe executor with every stage on the CPU, all splits of a model
   round-robin in a new order each round, warm-up rounds dropped. On one CPU the executor
   runs the stages one after another, so a step is the sum of the stages and tells little
   about the split; each stage is therefore also timed alone (as the balance suite does),
   and the slowest, the bottleneck a pipeline of K devices waits for, is compared too.

Writes ``estimates.{json,md,png}`` to ``benchmarks/results/`` or ``--out``; progress on stderr.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from autopipe import GPipe, plan
from autopipe.cli.model_file import as_sequential, load_split
from autopipe.output.timeline import checkpointed
from autopipe.planning.hardware.device_catalog import CatalogDevice, measured_device
from autopipe.planning.hardware.estimates import Efficiency, estimate_profile, fit_efficiency
from autopipe.planning.model.plans import Plan
from autopipe.planning.planner import evaluate
from benchmarks.balance.stage_timing import StageTimer, as_tuple, summarize
from benchmarks.models import ZOO
from benchmarks.planning.estimates_report import draw, render
from benchmarks.processes import MALLOC, rerun_with_stable_malloc
from profiler import profile_model
from profiler.profile import Profile
from profiler.roofline import measure_peaks

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
EXAMPLES = {"hf-gpt2": ROOT / "examples" / "gpt2.py"}
MODELS = (*ZOO, *EXAMPLES)
STAGES = (2, 4)
CHUNKS = 4
SOURCES = ("measured", "fitted", "default")
# A unit measured at or below this is left out of the errors, as the fit leaves it out.
NEGLIGIBLE = 1e-7
GOAL = 0.05  # the estimate's split within 5% of the measured profile's
# Timed rounds and dropped warm-up rounds of every split's step; full and --quick.
REPEATS, WARMUP = 20, 3
QUICK_REPEATS, QUICK_WARMUP = 3, 1
# Fewer rounds (not under MIN_REPEATS) for a model whose steps would take longer than this.
STEP_BUDGET, MIN_REPEATS = 100.0, 7
# Rounds of stage timing per round of steps: a round of stages costs less than one of steps
# (a micro-batch per stage) and their medians are noisier (milliseconds each).
STAGE_ROUNDS = 2


class _Spread(nn.Module):
    """A first unit that takes several inputs, called with GPipe's one tuple spread out."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.unit = unit

    def forward(self, inputs: tuple[Tensor, ...]) -> Any:
        return self.unit(*inputs)


def _loss(output: Any) -> Tensor:
    """The mean of the first floating output: a step's backward starts from it."""
    for value in as_tuple(output):
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.float().mean()
    raise ValueError("the model returns no floating tensor to take a loss of")


def _load(name: str) -> tuple[nn.Sequential, tuple[Tensor, ...]]:
    """A model's units and its sample as a tuple of the first unit's inputs."""
    if name in EXAMPLES:
        _, seq, sample = load_split(EXAMPLES[name])
    else:
        seq, sample = as_sequential(ZOO[name].model(), ZOO[name].sample())
    return seq, as_tuple(sample)


def _pipeline(seq: nn.Sequential, sample: tuple[Tensor, ...], p: Plan) -> GPipe:
    """The plan's split on the GPipe executor, every stage on the CPU."""
    units = copy.deepcopy(seq)
    if len(sample) > 1:  # GPipe passes one value on, as nn.Sequential does
        units[0] = _Spread(units[0])
    return GPipe(
        units, p.balance, devices=["cpu"] * p.num_stages, chunks=p.chunks, checkpoint=p.checkpoint
    )


def time_steps(
    pipes: list[GPipe], sample: tuple[Tensor, ...], repeats: int, warmup: int
) -> list[list[float]]:
    """Seconds of whole training steps of each pipeline, round-robin in a new order each
    round, the garbage collector paused within a round; the warm-up rounds are dropped.

    A model whose rounds are slow gets fewer of them (at least :data:`MIN_REPEATS`), so
    that its steps take about :data:`STEP_BUDGET` seconds.
    """
    x: Tensor | tuple[Tensor, ...] = sample[0] if len(sample) == 1 else sample
    samples: list[list[float]] = [[] for _ in pipes]
    order = list(range(len(pipes)))
    shuffle = random.Random(0).shuffle
    enabled = gc.isenabled()
    rounds, r, begin = warmup + repeats, 0, time.perf_counter()
    try:
        while r < rounds:
            if r == warmup and warmup:
                took = (time.perf_counter() - begin) / warmup
                rounds = warmup + min(repeats, max(MIN_REPEATS, int(STEP_BUDGET / took)))
            shuffle(order)
            gc.collect()
            gc.disable()
            for i in order:
                pipes[i].zero_grad(set_to_none=True)
                start = time.perf_counter()
                _loss(pipes[i](x)).backward()
                if r >= warmup:
                    samples[i].append(time.perf_counter() - start)
            if enabled:
                gc.enable()
            r += 1
    finally:
        if enabled:
            gc.enable()
    return samples


def _stages(p: Plan, timer: StageTimer) -> list[list[float]]:
    """Each stage of a plan alone, per round: forward + backward + its share of
    re-computation (a no-grad forward)."""
    out = []
    for s in p.stages:
        share = sum(checkpointed(p, i, s.index) for i in range(p.chunks)) / p.chunks
        train = timer.samples[(s.start, s.stop, p.micro_batch, True)]
        forward = timer.samples[(s.start, s.stop, p.micro_batch, False)]
        out.append([t + share * f for t, f in zip(train, forward, strict=True)])
    return out


def _paired(samples: list[float], reference: list[float]) -> dict[str, float]:
    """The median of the per-round ratios (both ran in every round, so a change in load
    hits both), with their quartiles and spread."""
    timing = summarize([a / b for a, b in zip(samples, reference, strict=True)])
    return {"median": timing.median, "q1": timing.q1, "q3": timing.q3, "spread": timing.spread}


def _layer_rows(measured: Profile, fitted: Profile, default: Profile) -> list[dict[str, Any]]:
    """Per unit, forward + backward seconds at the micro-batch size, measured and estimated,
    and the estimates' errors: the largest over the batch sizes, as the fit's own."""
    size = measured.batch_sizes.index(-(-measured.batch_size // measured.chunks))
    rows = []
    for m, f, d in zip(measured.layers, fitted.layers, default.layers, strict=True):
        real = [a + b for a, b in zip(m.forward, m.backward)]
        row: dict[str, Any] = {"name": m.name, "kind": m.kind, "measured": real[size]}
        for label, layer in (("fitted", f), ("default", d)):
            guess = [a + b for a, b in zip(layer.forward, layer.backward)]
            errors = [abs(g - r) / r for g, r in zip(guess, real) if r > NEGLIGIBLE]
            row[label] = guess[size]
            row[f"{label}_error"] = max(errors) if errors else None
        rows.append(row)
    return rows


def _errors(rows: list[dict[str, Any]], label: str) -> dict[str, float]:
    errors = [r[f"{label}_error"] for r in rows if r[f"{label}_error"] is not None]
    return {"median": statistics.median(errors), "max": max(errors)}


def bench_model(
    name: str, device: CatalogDevice, repeats: int, warmup: int, profile_repeats: int
) -> dict[str, Any]:
    """Profiles, estimates, plans and measures one model.

    Args:
        name: a zoo key or ``hf-gpt2``.
        device: the CPU as a catalog device.
        repeats: timed rounds of every split (steps and stages alike).
        warmup: dropped rounds of steps before them.
        profile_repeats: timed runs per layer when profiling.

    Returns:
        The model's JSON record.
    """
    torch.manual_seed(0)
    begin = time.perf_counter()
    seq, sample = _load(name)
    measured = profile_model(seq, sample, chunks=CHUNKS, repeats=profile_repeats, warmup=1)
    profile_seconds = time.perf_counter() - begin
    fit = fit_efficiency(measured, device)
    profiles = {
        "measured": measured,
        "fitted": estimate_profile(measured, device, efficiency=fit.efficiency),
        "default": estimate_profile(measured, device, efficiency=Efficiency()),
    }
    layers = _layer_rows(*profiles.values())
    print(
        f"  {name}: {len(seq)} units, batch {measured.batch_size}, profiled in "
        f"{profile_seconds:.1f} s; {fit.summary()}",
        file=sys.stderr,
    )
    # Distinct splits: one measurement each, whichever profiles chose it.
    splits: dict[tuple[int, ...], Plan] = {}
    rows: list[dict[str, Any]] = []
    for stages in STAGES:
        if stages > len(seq):
            continue
        for source, profile in profiles.items():
            p = plan(profile, stages, chunks=CHUNKS)
            splits.setdefault(tuple(p.balance), p)
            rows.append(
                {
                    "stages": stages,
                    "source": source,
                    "balance": list(p.balance),
                    "predicted_step": p.step_time,
                    # The split under the measured profile's costs: what it is really worth.
                    "measured_profile_step": evaluate(measured, p.balance, chunks=CHUNKS).step_time,
                }
            )
    keys = list(splits)
    begin = time.perf_counter()
    pipes = [_pipeline(seq, sample, splits[k]) for k in keys]
    steps = time_steps(pipes, sample, repeats, warmup)
    for pipe in pipes:
        pipe.close()
    timer = StageTimer(seq, sample)
    jobs = set()
    for p in splits.values():
        for s in p.stages:
            jobs.add((s.start, s.stop, p.micro_batch, True))
            jobs.add((s.start, s.stop, p.micro_batch, False))
    rounds = len(steps[0])
    timer.run(jobs, STAGE_ROUNDS * rounds)
    per_stage = {k: _stages(splits[k], timer) for k in keys}
    # A pipeline of K devices waits for its slowest stage: per round, the largest.
    worst = {k: [max(t) for t in zip(*per_stage[k])] for k in keys}
    print(
        f"    {len(keys)} distinct splits x {rounds} rounds, {len(jobs)} stage jobs x "
        f"{STAGE_ROUNDS * rounds} in {time.perf_counter() - begin:.1f} s",
        file=sys.stderr,
    )
    measured_split = {r["stages"]: tuple(r["balance"]) for r in rows if r["source"] == "measured"}
    predicted = {r["stages"]: r["measured_profile_step"] for r in rows if r["source"] == "measured"}
    for row in rows:
        key, base = tuple(row["balance"]), measured_split[row["stages"]]
        step, ref = steps[keys.index(key)], steps[keys.index(base)]
        step_ratio, bottleneck_ratio = _paired(step, ref), _paired(worst[key], worst[base])
        row.update(
            same_as_measured=key == base,
            predicted_ratio=row["measured_profile_step"] / predicted[row["stages"]],
            step=summarize(step).to_dict(),
            step_ratio=step_ratio["median"],
            step_ratio_spread=step_ratio,
            stage_times=[statistics.median(t) for t in per_stage[key]],
            bottleneck=summarize(worst[key]).to_dict(),
            bottleneck_ratio=bottleneck_ratio["median"],
            bottleneck_ratio_spread=bottleneck_ratio,
        )
    return {
        "model": name,
        "units": len(seq),
        "batch": measured.batch_size,
        "micro_batch": -(-measured.batch_size // CHUNKS),
        "profile_seconds": profile_seconds,
        "repeats": rounds,
        "stage_rounds": STAGE_ROUNDS * rounds,
        "fit": {
            "efficiency": fit.efficiency.to_dict(),
            "median_error": fit.median_error,
            "max_error": fit.max_error,
            "notes": list(fit.notes),
            "summary": fit.summary(),
        },
        "unit_errors": {label: _errors(layers, label) for label in ("fitted", "default")},
        "layers": layers,
        "splits": [
            {
                "balance": list(k),
                "step": summarize(steps[i]).to_dict(),
                "stages": [summarize(t).to_dict() for t in per_stage[k]],
                "bottleneck": summarize(worst[k]).to_dict(),
            }
            for i, k in enumerate(keys)
        ],
        "rows": rows,
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_REPEATS} timing rounds, one profiling run per layer",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated subset of {', '.join(MODELS)}"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"output folder ({RESULTS})")
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in MODELS]
    if unknown or not args.names:
        parser.error(f"unknown models {unknown}; choose from {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark and writes the JSON, the Markdown report and the picture.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    args = _parse(argv)
    begin = time.perf_counter()
    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    repeats, warmup = (QUICK_REPEATS, QUICK_WARMUP) if args.quick else (REPEATS, WARMUP)
    print(f"estimated vs measured times on this CPU -> {args.out} ...", file=sys.stderr)
    figures = measure_peaks("cpu", ("float32",), seconds=1.0 if args.quick else 3.0)
    device = measured_device(figures)
    print(
        f"  host: {device.name}, float32 peak {device.peak('float32') / 1e9:.1f} GFLOP/s, "
        f"memory bandwidth {device.memory_bandwidth / 1e9:.1f} GB/s (one thread)",
        file=sys.stderr,
    )
    models = [
        bench_model(name, device, repeats, warmup, 1 if args.quick else 3) for name in args.names
    ]
    default = args.names == list(MODELS) and not args.quick
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "malloc": MALLOC if all(os.environ.get(k) == v for k, v in MALLOC.items()) else None,
            "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        },
        "mode": "quick" if args.quick else "full" if default else "reduced",
        "device": {"figures": figures, "key": device.key, "name": device.name},
        "default_efficiency": Efficiency().to_dict(),
        "chunks": CHUNKS,
        "stages": list(STAGES),
        "repeats": repeats,
        "warmup": warmup,
        "goal": GOAL,
        "wall_seconds": time.perf_counter() - begin,
        "models": models,
    }
    (args.out / "estimates.json").write_text(json.dumps(results, indent=1) + "\n")
    report = render(results)
    (args.out / "estimates.md").write_text(report)
    draw(results, args.out / "estimates.png")
    print(report)
    return 0


if __name__ == "__main__":
    rerun_with_stable_malloc("benchmarks.planning.estimates")
    raise SystemExit(main())
