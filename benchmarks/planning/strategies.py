"""Planning speed and each strategy's bottleneck relative to the optimum.

Run: ``python -m benchmarks.planning.strategies [--quick]``. Prints tables and saves
``benchmarks/results/planning.{json,md,png}``; ``--partition-only`` re-measures the
``partition`` table alone and keeps the saved results' other tables.
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

from autopipe import partition, plan
from autopipe.errors import PlanningError
from profiler.profile import LayerProfile, Profile

RESULTS = Path(__file__).resolve().parents[1] / "results"
STRATEGIES = ("uniform", "parameters", "blockpartition", "torchtitan", "optimal")


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def planning_speed(quick: bool) -> list[dict[str, Any]]:
    """Median seconds of ``partition`` (optimal) with and without memory caps."""
    rng = np.random.default_rng(0)
    sizes = (1_000, 10_000, 100_000) if quick else (1_000, 10_000, 100_000, 1_000_000)
    rows = []
    for n in sizes:
        costs = rng.lognormal(size=n)
        memory = rng.lognormal(size=n)
        for stages in (8, 16, 32, 64):
            cap = 1.3 * memory.sum() / stages
            free = _timed(lambda c=costs, k=stages: partition(c, k), 3)
            capped = _timed(
                lambda c=costs, m=memory, k=stages, cap=cap: partition(
                    c, k, memory=m, capacity=cap
                ),
                3,
            )
            rows.append({"layers": n, "stages": stages, "seconds": free, "capped_seconds": capped})
            print(
                f"  partition L={n:>9,} K={stages:>2}: {free * 1e3:8.2f} ms, "
                f"with memory caps {capped * 1e3:8.2f} ms",
                file=sys.stderr,
            )
    return rows


def plan_speed() -> list[dict[str, Any]]:
    """Median seconds of the full step-time planner (``plan``) on random profiles."""
    rng = np.random.default_rng(2)
    rows = []
    for n in (100, 500, 1000):
        profile = _random_profile(rng, n)
        for stages in (4, 16, 64):
            seconds = _timed(lambda p=profile, k=stages: plan(p, k), 3)
            rows.append({"layers": n, "stages": stages, "seconds": seconds})
            print(f"  plan L={n:>5} K={stages:>2}: {seconds * 1e3:8.1f} ms", file=sys.stderr)
    return rows


def _random_profile(rng: np.random.Generator, n: int) -> Profile:
    forward = rng.lognormal(sigma=1.0, size=n) * 1e-3
    params = (rng.lognormal(sigma=1.5, size=n) * 1e6).astype(int)
    # Named as torchtitan names a decoder-only model, so that its default split applies too.
    names = ["tok_embeddings", *(f"layers.{i}" for i in range(n - 2)), "norm+output"]
    layers = [
        LayerProfile(
            name=names[i],
            kind="Layer",
            forward=[forward[i] / 2, forward[i]],
            backward=[forward[i], 2 * forward[i]],
            saved=[0, 0],
            output=[0, 0],
            param_bytes=int(params[i]),
        )
        for i in range(n)
    ]
    return Profile(layers=layers, batch_sizes=[4, 8], input=[0, 0], batch_size=32, chunks=4)


def strategy_quality(quick: bool) -> list[dict[str, Any]]:
    """Bottleneck of each strategy / optimal on random lognormal profiles."""
    rng = np.random.default_rng(1)
    rows = []
    trials = 50 if quick else 200
    for stages in (2, 4, 8, 16):
        ratios: dict[str, list[float]] = {s: [] for s in STRATEGIES}
        for _ in range(trials):
            n = int(rng.integers(4 * stages, 16 * stages))
            profile = _random_profile(rng, n)
            best = plan(profile, stages, checkpoint="never").bottleneck
            for strategy in STRATEGIES:
                got = plan(profile, stages, checkpoint="never", strategy=strategy).bottleneck
                ratios[strategy].append(got / best)
        for strategy in STRATEGIES:
            values = np.array(ratios[strategy])
            rows.append(
                {
                    "stages": stages,
                    "strategy": strategy,
                    "mean_ratio": float(values.mean()),
                    "worst_ratio": float(values.max()),
                    "suboptimal_share": float(np.mean(values > 1 + 1e-9)),
                }
            )
        print(f"  random profiles K={stages}: done", file=sys.stderr)
    return rows


def example_quality(repeats: int) -> list[dict[str, Any]]:
    """Bottleneck and step time of each strategy on the bundled examples, profiled on CPU."""
    from autopipe.cli.model_file import load_sequential
    from profiler import profile_model

    rows = []
    for path in sorted(Path("examples").glob("*.py")):
        try:
            model, sample = load_sequential(path)
        except ValueError:
            continue  # Not a planning example (e.g. a training script).
        if any(p.is_meta for p in model.parameters()):
            continue  # A giant model on the meta device: it is counted, not timed here.
        print(f"  profiling {path} ...", file=sys.stderr)
        profile = profile_model(model, sample, chunks=4, repeats=repeats)
        for stages in (2, 4):
            if stages > len(profile):
                continue
            best = plan(profile, stages)
            for strategy in STRATEGIES:
                try:
                    got = plan(profile, stages, strategy=strategy)
                except PlanningError:  # the peer gives no split of this model (torchtitan)
                    continue
                rows.append(
                    {
                        "example": path.name,
                        "stages": stages,
                        "strategy": strategy,
                        "balance": got.balance,
                        "bottleneck_ratio": got.bottleneck / best.bottleneck,
                        "step_ratio": got.step_time / best.step_time,
                    }
                )
    return rows


def _markdown(results: dict[str, Any]) -> str:
    lines = ["# Planning benchmark", "", f"Machine: {results['machine']}", ""]
    lines += ["## `partition` speed (optimal, median of 3)", ""]
    lines += ["| layers | K | no memory caps | with memory caps |", "|---:|---:|---:|---:|"]
    for r in results["speed"]:
        lines.append(
            f"| {r['layers']:,} | {r['stages']} | {r['seconds'] * 1e3:.2f} ms "
            f"| {r['capped_seconds'] * 1e3:.2f} ms |"
        )
    lines += ["", "## `plan` speed (full cost model, checkpointing, Adam; median of 3)", ""]
    lines += ["| layers | K | seconds |", "|---:|---:|---:|"]
    for r in results["plan_speed"]:
        lines.append(f"| {r['layers']:,} | {r['stages']} | {r['seconds']:.3f} |")
    lines += ["", "## Bottleneck relative to optimal, random lognormal profiles", ""]
    lines += ["| K | strategy | mean | worst | suboptimal |", "|---:|---|---:|---:|---:|"]
    for r in results["random"]:
        lines.append(
            f"| {r['stages']} | {r['strategy']} | {r['mean_ratio']:.3f} | "
            f"{r['worst_ratio']:.3f} | {r['suboptimal_share']:.0%} |"
        )
    if results["examples"]:
        lines += ["", "## Bundled examples (profiled on this machine's CPU, M=4)", ""]
        lines += [
            "| example | K | strategy | balance | bottleneck / optimal | step / optimal |",
            "|---|---:|---|---|---:|---:|",
        ]
        for r in results["examples"]:
            lines.append(
                f"| {r['example']} | {r['stages']} | {r['strategy']} | {r['balance']} | "
                f"{r['bottleneck_ratio']:.3f} | {r['step_ratio']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = results["random"]
    ks = sorted({r["stages"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(STRATEGIES)
    for i, strategy in enumerate(STRATEGIES):
        means = [
            next(r["mean_ratio"] for r in rows if r["stages"] == k and r["strategy"] == strategy)
            for k in ks
        ]
        worst = [
            next(r["worst_ratio"] for r in rows if r["stages"] == k and r["strategy"] == strategy)
            for k in ks
        ]
        xs = np.arange(len(ks)) + i * width
        ax.bar(xs, means, width, label=strategy)
        ax.scatter(xs, worst, color="black", marker="_", s=80, zorder=3)
    ax.set_xticks(np.arange(len(ks)) + 0.4 - width / 2, [f"K={k}" for k in ks])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("bottleneck / optimal (bar: mean, tick: worst)")
    ax.set_title("Balance quality on random lognormal layer costs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _machine() -> str:
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"{platform.machine()} {platform.processor() or ''}, Python {platform.python_version()}"
        f" (load average {load} when the partition table was measured)"
    )


def _remeasure_partition(quick: bool) -> int:
    results = json.loads((RESULTS / "planning.json").read_text())
    results["machine"] = _machine()
    results["speed"] = planning_speed(quick)
    (RESULTS / "planning.json").write_text(json.dumps(results, indent=1))
    report = _markdown(results)
    (RESULTS / "planning.md").write_text(report)
    print(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer trials")
    parser.add_argument("--no-examples", action="store_true", help="skip profiling examples")
    parser.add_argument(
        "--partition-only",
        action="store_true",
        help="re-measure the partition speed table only, keeping the saved results' others",
    )
    args = parser.parse_args(argv)
    if args.partition_only:
        return _remeasure_partition(args.quick)
    print("planning speed ...", file=sys.stderr)
    speed = planning_speed(args.quick)
    plan_rows = plan_speed()
    print("strategy quality on random profiles ...", file=sys.stderr)
    random_rows = strategy_quality(args.quick)
    examples = [] if args.no_examples else example_quality(repeats=3)
    results = {
        "machine": _machine(),
        "speed": speed,
        "plan_speed": plan_rows,
        "random": random_rows,
        "examples": examples,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planning.json").write_text(json.dumps(results, indent=1))
    report = _markdown(results)
    (RESULTS / "planning.md").write_text(report)
    if _plot(results, RESULTS / "planning.png"):
        print(f"picture: {RESULTS / 'planning.png'}", file=sys.stderr)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
