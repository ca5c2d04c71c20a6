"""Re-computation modes under one memory cap, measured on two gloo ranks.

For each model of the zoo it finds (bisecting ``autopipe plan --memory``) the least memory
any split of K = 2 stages (1F1B, M = 4, SGD) needs with ``never`` and with ``always``, sets
the cap halfway between the two, and then runs
``autopipe bench --ranks 2 --checkpoint MODE --memory CAP`` for every mode
(``never``, ``always``, ``except_last``, ``auto``): whether the mode's best split fits the
cap, each stage's memory (the plan's parameters and state plus the saved-for-backward
bytes measured on the rank) and the measured step (median of the timed steps). ``auto``
re-computes, per stage, the cheapest set of units that fits (or the whole stage), chosen
with the split; the goal is that it fits and steps in at most 0.9x the ``always`` plan's
time on at least two models.

Run: ``python -m benchmarks.balance.recompute_bench [--models resnet,gpt2] [--out DIR]``;
results go to ``benchmarks/results/recompute_bench.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.balance.bench_suite import MODELS
from benchmarks.processes import ROOT, rerun_with_stable_malloc, run_autopipe

RESULTS = ROOT / "benchmarks" / "results"
MODES = ("never", "always", "except_last", "auto")
COMMON = ["--device", "cpu", "--stages", "2", "--schedule", "1f1b", "--chunks", "4"]
STEPS, WARMUP = 6, 4
TIMEOUT = 900


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return run_autopipe(command, TIMEOUT)


def _last_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
    return lines[-1].removeprefix("autopipe: error: ")


def planned_peak(path: str, mode: str, cap: int | None = None) -> float | None:
    """The largest stage memory of the optimal plan in ``mode`` (under ``cap``), or None
    where no split fits under ``cap``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "plan.json"
        command = ["plan", path, *COMMON, "--optimizer", "sgd", "--checkpoint", mode]
        command += ["--json", str(out)] + ([] if cap is None else ["--memory", f"{cap}B"])
        done = _run(command)
        if done.returncode != 0:
            if cap is not None:
                return None
            raise SystemExit(f"planning {path} with {mode} failed: {_last_line(done)}")
        plan = json.loads(out.read_text())
    return float(max(stage["memory"] for stage in plan["stages"]))


def least_need(path: str, mode: str, steps: int = 7) -> float:
    """The least cap under which some split fits in ``mode`` (bisection on the plan)."""
    hi = planned_peak(path, mode)
    assert hi is not None
    lo = 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if planned_peak(path, mode, int(mid)) is not None else (mid, hi)
    return hi


def bench_mode(path: str, mode: str, cap: int) -> dict[str, Any]:
    """One ``autopipe bench --ranks 2`` of the optimal split in ``mode`` under ``cap``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "bench.json"
        command = ["bench", path, *COMMON, "--ranks", "2", "--strategies", "optimal"]
        command += ["--checkpoint", mode, "--memory", f"{cap}B", "--steps", str(STEPS)]
        command += ["--warmup", str(WARMUP), "--json", str(out)]
        done = _run(command)
        if done.returncode != 0 or not out.exists():
            return {"fits": False, "message": _last_line(done)}
        record = json.loads(out.read_text())
    split = record["splits"][0]
    plan = record["plans"]["optimal"]
    # What a stage holds: its planned state and the bytes it measured saved for backward.
    memory = [
        stage["param_memory"] + saved for stage, saved in zip(plan["stages"], split["saved_peak"])
    ]
    return {
        "fits": True,
        "balance": split["balance"],
        "step": split["measured"],
        "spread": split["spread"],
        "predicted": split["predicted"],
        "memory": memory,
        "predicted_memory": [stage["memory"] for stage in plan["stages"]],
        "modes": [stage["checkpoint"] for stage in plan["stages"]],
        "units": [stage.get("recompute_units", []) for stage in plan["stages"]],
        "within": all(m <= cap for m in memory),
    }


def render(record: dict[str, Any]) -> str:
    lines = [
        "# Re-computation modes under one memory cap, on two gloo ranks",
        "",
        f"`python -m benchmarks.balance.recompute_bench` on {record['machine']}: K = 2 stages, "
        f"1F1B, M = 4, SGD, {STEPS} timed steps after {WARMUP} warm-up; the cap halfway "
        "between the least memory a split needs under `never` and under `always` (bisected "
        "over the planner's `--memory`). Memory: per stage, its "
        "parameters and state plus the saved-for-backward bytes measured on its rank "
        "(within: both under the cap). Step: the median measured step (± the interquartile "
        "range over it), and its ratio to `always`'s. Whole run "
        f"{record['seconds'] / 60:.1f} min.",
        "",
        "| model | cap | mode | fits | memory per stage | within | step | / always | stages |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in record["models"].items():
        cap = f"{row['cap'] / 2**20:.1f} MiB"
        always = row["modes"]["always"]
        for mode in MODES:
            found = row["modes"][mode]
            if not found["fits"]:
                lines.append(
                    f"| {name} | {cap} | {mode} | no | - | - | - | - | {found['message'][:90]} |"
                )
                continue
            memory = ", ".join(f"{m / 2**20:.1f}" for m in found["memory"]) + " MiB"
            ratio = f"{found['step'] / always['step']:.2f}" if always["fits"] else "-"
            stages = "; ".join(
                f"{m} {units}" if units else m for m, units in zip(found["modes"], found["units"])
            )
            lines.append(
                f"| {name} | {cap} | {mode} | yes | {memory} | "
                f"{'yes' if found['within'] else 'no'} | {found['step'] * 1e3:.0f} ms "
                f"±{found['spread']:.0%} | {ratio} | {stages} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet,unet,gpt2,llama-untied")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    begin = time.perf_counter()
    models: dict[str, Any] = {}
    for name in args.models.split(","):
        path = MODELS[name]
        # Between the least memory a split needs keeping everything and re-computing
        # every micro-batch: ``never`` cannot fit, ``always`` can.
        never, always = least_need(path, "never"), least_need(path, "always")
        cap = int((never + always) / 2)
        models[name] = {"cap": cap, "never": never, "always": always, "modes": {}}
        for mode in MODES:
            print(f"{name} {mode} under {cap / 2**20:.1f} MiB ...", file=sys.stderr, flush=True)
            models[name]["modes"][mode] = bench_mode(path, mode, cap)
    record = {
        "machine": f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
        "seconds": time.perf_counter() - begin,
        "models": models,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recompute_bench.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "recompute_bench.md").write_text(render(record))
    print(f"results written to {args.out}/recompute_bench.{{json,md}}", file=sys.stderr)


if __name__ == "__main__":
    rerun_with_stable_malloc("benchmarks.balance.recompute_bench")
    main()
