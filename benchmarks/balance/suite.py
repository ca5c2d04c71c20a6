"""Balance quality on the model zoo: predicted vs measured stage times of every strategy.

Run: ``python -m benchmarks.balance.suite [--quick] [--models a,b] [--stages 2,4] [--repeats N]
[--out DIR]``. Each zoo model is cut into units, profiled once on this machine's CPU (one
thread), and planned with every strategy for K = 2, 4, 8 stages, plus the optimal plan under
a per-device memory limit chosen to bind but fit (``benchmarks.balance.memory_limit``). Every
planned stage is then run alone on its micro-batch inputs (forward + backward, plus the
share of re-computation forwards the stage checkpoints), all stages of a model interleaved
round-robin (``benchmarks.balance.stage_timing``), so the real bottleneck of each plan is measured,
not only predicted. A last table puts GPipe's Table 2 (normalized throughput against K and
M) in our terms, as predictions from the CPU profiles. Writes ``balance.{json,md}``,
``balance_<model>.png`` (stage bars) and ``timeline_<model>.png`` (pipeline timeline of the
optimal plan) to ``benchmarks/results/`` or ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from autopipe import Plan, PlanningError, plan
from autopipe.cli.model_file import as_sequential
from autopipe.output.timeline import checkpointed
from benchmarks.balance.memory_limit import MARGIN, MemoryLimit, choose_limit, peak_memory
from benchmarks.balance.report import MEMORY_LABEL, noise_summary, render
from benchmarks.balance.stage_timing import Job, StageTimer, Timing, as_tuple
from benchmarks.models import ZOO
from profiler import profile_model
from profiler.devices import cpu_model
from profiler.profile import Profile

RESULTS = Path(__file__).resolve().parents[1] / "results"
STRATEGIES = ("uniform", "parameters", "blockpartition", "torchtitan", "optimal")
# torchtitan's split places an embedding, decoder layers and an output: models of another
# shape get no plan from it ("n/a" in the tables), not a failed run.
SHAPED = ("torchtitan",)
LABELS = (*STRATEGIES, MEMORY_LABEL)
STAGES = (2, 4, 8)
PICTURE_STAGES = 4
CHUNKS = 4
TABLE2_CHUNKS = (1, 4, 32)
# Rounds of stage timing. A round of all five zoo models at K = 2, 4, 8 takes about 2-4 s
# on the 2-core machine, so 30 rounds keep the full run near 2-3 minutes while the
# median of 30 moves little when a few rounds are disturbed.
REPEATS = 30
QUICK_REPEATS = 3
# GPipe (Huang et al., 2019), Table 2: normalized throughput on TPUs, M = 1 / 4 / 32.
GPIPE_TABLE2 = {
    "AmoebaNet-D": {2: (1.0, 1.07, 1.21), 4: (1.13, 1.26, 1.84), 8: (1.38, 1.72, 3.48)},
    "Transformer-48": {2: (1.0, 1.7, 1.8), 4: (1.07, 3.2, 3.4), 8: (1.3, 4.8, 6.3)},
}


def _recomputed(p: Plan, stage: int) -> float:
    """Share of micro-batches whose forward ``stage`` re-computes in backward."""
    return sum(checkpointed(p, i, stage) for i in range(p.chunks)) / p.chunks


def _plans(
    profile: Profile, stages: int
) -> tuple[dict[str, Plan | None], dict[str, float], MemoryLimit]:
    """Plans of every strategy at ``stages``; ``None`` where it does not fit."""
    plans: dict[str, Plan | None] = {}
    seconds: dict[str, float] = {}
    for strategy in STRATEGIES:
        begin = time.perf_counter()
        try:
            plans[strategy] = plan(profile, stages, chunks=CHUNKS, strategy=strategy)
        except PlanningError:
            if strategy not in SHAPED:
                raise
            plans[strategy] = None
        seconds[strategy] = time.perf_counter() - begin
    limit = choose_limit(profile, stages, chunks=CHUNKS)
    begin = time.perf_counter()
    try:
        plans[MEMORY_LABEL] = plan(profile, stages, chunks=CHUNKS, memory=limit.limit)
    except PlanningError:  # not expected: the limit is at least the least feasible capacity
        plans[MEMORY_LABEL] = None
    seconds[MEMORY_LABEL] = time.perf_counter() - begin
    return plans, seconds, limit


def _jobs(p: Plan) -> set[Job]:
    """The timing jobs a plan's stages need: train always, a forward if it re-computes."""
    jobs: set[Job] = set()
    for s in p.stages:
        jobs.add((s.start, s.stop, p.micro_batch, True))
        if _recomputed(p, s.index) > 0:
            jobs.add((s.start, s.stop, p.micro_batch, False))
    return jobs


def _row(
    p: Plan | None,
    label: str,
    stages: int,
    best: Plan,
    capacity: int | None,
    timings: list[Timing] | None,
    best_measured: float,
) -> dict[str, Any]:
    """One plan's JSON row: predictions, per-stage memory, measurements, ratios to optimal."""
    row: dict[str, Any] = {"stages": stages, "strategy": label, "fits": p is not None}
    if p is None and label in SHAPED:
        row["applies"] = False  # the model lacks the shape the strategy splits
    if p is None or timings is None:
        row["capacity"] = capacity
        return row
    measured = [t.median for t in timings]
    worst = max(range(len(measured)), key=measured.__getitem__)
    row.update(
        balance=list(p.balance),
        capacity=p.stages[0].capacity,
        predicted_bottleneck=p.bottleneck,
        predicted_bottleneck_stage=p.bottleneck_stage,
        predicted_step=p.step_time,
        predicted_ratio=p.bottleneck / best.bottleneck,
        max_stage_memory=peak_memory(p),
        stage_memory=[s.memory for s in p.stages],
        stage_param_memory=[s.param_memory for s in p.stages],
        predicted_stage_times=[s.time for s in p.stages],
        measured_stage_times=measured,
        measured_stage_timings=[t.to_dict() for t in timings],
        measured_bottleneck=measured[worst],
        measured_bottleneck_stage=worst,
        measured_bottleneck_spread=timings[worst].spread,
        measured_ratio=measured[worst] / best_measured,
    )
    return row


def _draw(name: str, out: Path, bars: dict[str, Plan]) -> dict[str, str]:
    """Stage bars of every plan and the optimal plan's timeline; none without matplotlib."""
    from autopipe.output.timeline import draw_stage_bars, draw_timeline

    pictures: dict[str, str] = {}
    try:
        draw_stage_bars(bars, out / f"balance_{name}.png")
        pictures["bars"] = f"balance_{name}.png"
        draw_timeline(bars["optimal"], out / f"timeline_{name}.png")
        pictures["timeline"] = f"timeline_{name}.png"
    except ImportError:
        print("    matplotlib missing: no pictures", file=sys.stderr)
    return pictures


def bench_model(
    name: str, stage_counts: list[int], repeats: int, profile_repeats: int, out: Path
) -> dict[str, Any]:
    """Profiles, plans and measures one zoo model, and draws its pictures into ``out``.

    Args:
        name: a key of :data:`benchmarks.models.ZOO`.
        stage_counts: the K to plan for (those above the unit count are skipped).
        repeats: round-robin timing rounds of every stage.
        profile_repeats: timed runs per layer when profiling.
        out: folder for the pictures.

    Returns:
        The model's JSON record: plans, measurements, limits, Table 2, picture names.
    """
    module = ZOO[name]
    begin = time.perf_counter()
    seq, sample = as_sequential(module.model(), module.sample())
    profile = profile_model(seq, sample, chunks=CHUNKS, repeats=profile_repeats, warmup=1)
    profile_seconds = time.perf_counter() - begin
    print(
        f"  {name}: {len(seq)} units, batch {profile.batch_size}, profiled in "
        f"{profile_seconds:.1f} s",
        file=sys.stderr,
    )
    planned: dict[int, dict[str, Plan | None]] = {}
    planning: dict[str, dict[str, float]] = {}
    limits: dict[str, MemoryLimit] = {}
    for stages in stage_counts:
        if stages <= len(seq):
            planned[stages], planning[str(stages)], limits[str(stages)] = _plans(profile, stages)
    # Every distinct stage of every plan is timed in the same rounds, so ratios between
    # strategies and between K compare measurements taken under the same machine load.
    timer = StageTimer(seq, as_tuple(sample))
    jobs = {job for plans in planned.values() for p in plans.values() if p for job in _jobs(p)}
    begin = time.perf_counter()
    timer.run(jobs, repeats)
    measure_seconds = time.perf_counter() - begin
    print(
        f"    {len(jobs)} stage jobs x {repeats} rounds in {measure_seconds:.1f} s",
        file=sys.stderr,
    )
    rows: list[dict[str, Any]] = []
    for stages, plans in planned.items():
        timings = {
            label: [
                timer.stage(s.start, s.stop, p.micro_batch, _recomputed(p, s.index))
                for s in p.stages
            ]
            for label, p in plans.items()
            if p is not None
        }
        best = plans["optimal"]
        assert best is not None
        best_measured = max(t.median for t in timings["optimal"])
        capacity = limits[str(stages)].limit
        for label in LABELS:
            rows.append(
                _row(plans[label], label, stages, best, capacity, timings.get(label), best_measured)
            )
    shown = PICTURE_STAGES if PICTURE_STAGES in planned else max(planned)
    bars = {label: p for label, p in planned[shown].items() if p is not None}
    return {
        "model": name,
        "units": len(seq),
        "batch": profile.batch_size,
        "profile_seconds": profile_seconds,
        "measure_seconds": measure_seconds,
        "stage_jobs": len(jobs),
        "planning_seconds": planning,
        "memory_limits": {k: v.to_dict() for k, v in limits.items()},
        "rows": rows,
        "table2": table2(profile, len(seq)),
        "pictures": _draw(name, out, bars),
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


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_REPEATS} timing rounds, fewer profiling runs",
    )
    parser.add_argument(
        "--models", default=",".join(ZOO), help=f"comma-separated subset of {', '.join(ZOO)}"
    )
    parser.add_argument(
        "--stages",
        type=_ints,
        default=list(STAGES),
        help="comma-separated stage counts K (default 2,4,8)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"round-robin timing rounds per stage (default {REPEATS}, --quick {QUICK_REPEATS})",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"output folder ({RESULTS})")
    args = parser.parse_args(argv)
    args.names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in args.names if n not in ZOO]
    if unknown or not args.names:
        parser.error(f"unknown models {unknown}; choose from {', '.join(ZOO)}")
    if not args.stages or min(args.stages) < 2:
        parser.error("--stages needs stage counts of at least 2")
    if args.repeats is None:
        args.repeats = QUICK_REPEATS if args.quick else REPEATS
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Runs the suite and writes the JSON, the Markdown report and the pictures.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status, 0.
    """
    args = _parse(argv)
    begin = time.perf_counter()
    load_start = os.getloadavg()[0]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"balance on the model zoo -> {args.out} ...", file=sys.stderr)
    profile_repeats = 2 if args.quick else 3
    stage_counts = sorted(set(args.stages))
    models = [
        bench_model(name, stage_counts, args.repeats, profile_repeats, args.out)
        for name in args.names
    ]
    # "full" only for the default suite, so a reduced run is never taken for the real one.
    default = args.names == list(ZOO) and stage_counts == list(STAGES) and args.repeats == REPEATS
    mode = "quick" if args.quick else "full" if default else "reduced"
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": f"{platform.system()} {platform.machine()}",
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_average": {"start": load_start, "end": os.getloadavg()[0]},
        },
        "mode": mode,
        "repeats": args.repeats,
        "profile_repeats": profile_repeats,
        "chunks": CHUNKS,
        "stages": stage_counts,
        "picture_stages": PICTURE_STAGES if PICTURE_STAGES in stage_counts else max(stage_counts),
        "margin": MARGIN,
        "labels": list(LABELS),
        "table2_chunks": list(TABLE2_CHUNKS),
        "gpipe_table2": {k: {str(s): v for s, v in t.items()} for k, t in GPIPE_TABLE2.items()},
        "noise": noise_summary(models),
        "wall_seconds": time.perf_counter() - begin,
        "models": models,
    }
    (args.out / "balance.json").write_text(json.dumps(results, indent=1))
    report = render(results)
    (args.out / "balance.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
