"""Llama-3-70B and -405B shapes planned with ``auto`` re-computation against whole stages.

For each case (a model on the meta device, a catalog GPU, a pipeline of K stages, 1F1B,
``adam-mixed``, 64 micro-batches) it runs ``autopipe plan ... --json`` once per checkpoint
mode — ``always`` (every micro-batch re-computes its whole stage), ``except_last`` (the
runner's default), ``auto`` (each stage keeps everything if it fits, else re-computes the
cheapest set of its units or the whole stage, chosen with the split) — and records the
predicted step, the most memory a device holds, and how many units ``auto`` re-computes.
A mode that does not fit records by how much.

Run: ``python -m benchmarks.planning.giant_recompute [--cases 70b-h100-16,...]``; results
go to ``benchmarks/results/giant_recompute.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MODES = ("always", "except_last", "auto")
COMMON = ["--schedule", "1f1b", "--optimizer", "adam-mixed", "--chunks", "64"]
# (model file, catalog GPU, stages): the 70B on 16 and 32 stages of the 80 GB parts and on
# 16 H200s, the 405B on 64 H100s and H200s.
CASES: dict[str, tuple[str, str, int]] = {
    "70b-h100-16": ("examples/llama3_70b.py", "h100", 16),
    "70b-h100-32": ("examples/llama3_70b.py", "h100", 32),
    "70b-a100-80gb-32": ("examples/llama3_70b.py", "a100-80gb", 32),
    "70b-h200-16": ("examples/llama3_70b.py", "h200", 16),
    "405b-h100-64": ("examples/llama3_405b.py", "h100", 64),
    "405b-h200-64": ("examples/llama3_405b.py", "h200", 64),
}


def run_mode(model: str, gpu: str, stages: int, mode: str) -> dict[str, Any]:
    """One ``autopipe plan`` of the case in ``mode``: its step, memory and re-computation."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "plan.json"
        command = [sys.executable, "-m", "autopipe", "plan", model, "--target", gpu]
        command += ["--stages", str(stages), *COMMON, "--checkpoint", mode, "--json", str(path)]
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if done.returncode != 0 or not path.exists():
            line = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
            return {"fits": False, "message": line.removeprefix("autopipe: error: "), "s": seconds}
        plan = json.loads(path.read_text())
    stages_ = plan["stages"]
    units = sum(len(stage.get("recompute_units", [])) for stage in stages_)
    return {
        "fits": True,
        "step": plan["step_time"],
        "memory": max(stage["memory"] for stage in stages_),
        "capacity": stages_[0]["capacity"],
        "recompute": sum(stage["recompute"] for stage in stages_),
        "modes": sorted({stage["checkpoint"] for stage in stages_}),
        "units": units,
        "balance": plan["balance"],
        "s": seconds,
    }


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "# Giant models: `auto` re-computation against whole stages",
        "",
        "`python -m benchmarks.planning.giant_recompute`: `autopipe plan MODEL --target GPU "
        f"--stages K {' '.join(COMMON)} --checkpoint MODE` per mode (predicted, default "
        "efficiencies). Step: the predicted step; memory: the most a device holds, of its "
        "capacity; auto/always: the step of `auto` over that of `always`.",
        "",
        "| case | always | except_last | auto | auto's stages | auto/always |",
        "|---|---|---|---|---|---|",
    ]
    for case, modes in results.items():
        cells = []
        for mode in MODES:
            found = modes[mode]
            if found["fits"]:
                share = found["memory"] / found["capacity"] if found["capacity"] else 0.0
                cells.append(
                    f"{found['step']:.2f} s, {found['memory'] / 2**30:.1f} GiB ({share:.0%})"
                )
            else:
                cells.append("does not fit")
        auto = modes["auto"]
        what = (
            f"{'/'.join(auto['modes'])}; {auto['units']} units re-computed" if auto["fits"] else "-"
        )
        ratio = (
            f"{auto['step'] / modes['always']['step']:.2f}"
            if auto["fits"] and modes["always"]["fits"]
            else "-"
        )
        lines.append(f"| {case} | {' | '.join(cells)} | {what} | {ratio} |")
    lines.append("")
    for case, modes in results.items():
        for mode in MODES:
            if not modes[mode]["fits"]:
                lines.append(f"- {case}, {mode}: {modes[mode]['message']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for case in args.cases.split(","):
        model, gpu, stages = CASES[case]
        results[case] = {}
        for mode in MODES:
            print(f"{case} {mode} ...", file=sys.stderr, flush=True)
            results[case][mode] = run_mode(model, gpu, stages, mode)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "giant_recompute.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "giant_recompute.md").write_text(render(results))
    print(f"results written to {args.out}/giant_recompute.{{json,md}}", file=sys.stderr)


if __name__ == "__main__":
    main()
