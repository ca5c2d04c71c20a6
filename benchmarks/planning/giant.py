"""Planning Llama-3-70B and -405B shapes for GPU clusters, on this host: time and peak memory.

Each case runs ``autopipe plan`` on a model built on the meta device (examples/llama3_70b.py,
examples/llama3_405b.py) with ``--target``, in a process of its own, and records its wall
time and peak resident memory (the goals: under 60 s and 4 GiB each on the 2-core host)
and what it printed: the plan's step time and balance, or by how much it does not fit.

Run: ``python -m benchmarks.planning.giant [--cases 70b-32,...]``; results go to
``benchmarks/results/giant.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MIXED = ["--optimizer", "adam-mixed", "--chunks", "64"]
CASES: dict[str, list[str]] = {
    "70b-16": [
        "examples/llama3_70b.py",
        "--target",
        "h100",
        "--stages",
        "16",
        "--schedule",
        "1f1b",
        *MIXED,
    ],
    "70b-32": [
        "examples/llama3_70b.py",
        "--target",
        "h100",
        "--stages",
        "32",
        "--schedule",
        "1f1b",
        *MIXED,
    ],
    "70b-search-32": [
        "examples/llama3_70b.py",
        "--target",
        "h100",
        "--search",
        "--devices",
        "32",
        "--shard-optimizer",
        *MIXED,
    ],
    "405b-search-64-h100": [
        "examples/llama3_405b.py",
        "--target",
        "h100",
        "--search",
        "--devices",
        "64",
        "--shard-optimizer",
        *MIXED,
    ],
    "405b-search-64-h200": [
        "examples/llama3_405b.py",
        "--target",
        "h200",
        "--search",
        "--devices",
        "64",
        "--shard-optimizer",
        *MIXED,
    ],
}


# Runs the command line in this process and reports its peak resident memory on exit.
_WRAPPER = (
    "import atexit, resource, runpy, sys\n"
    "atexit.register(lambda: print(f'peak_kb={resource.getrusage(resource.RUSAGE_SELF)"
    ".ru_maxrss}', file=sys.stderr))\n"
    "sys.argv = ['autopipe', *sys.argv[1:]]\n"
    "runpy.run_module('autopipe', run_name='__main__')\n"
)


def run_case(argv: list[str]) -> dict[str, Any]:
    """Runs ``autopipe plan`` with ``argv``; its seconds, peak memory and outcome."""
    # --no-cache: each case times the whole work, not a profile cached by an earlier run.
    command = [sys.executable, "-c", _WRAPPER, "plan", *argv, "--no-cache"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    out, err = done.stdout, done.stderr
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    error = next((line for line in lines if line.startswith("autopipe: error:")), None)
    step = re.search(r"step time\s+([\d.]+ \w+) per mini-batch", out)
    balance = re.search(r"balance\s+(\[[\d, ]+\])", out)
    peak = re.search(r"^peak_kb=(\d+)$", err, re.MULTILINE)
    ranked = out.split("\n\nthe best plan:")[0].splitlines()[:4] if "--search" in argv else []
    return {
        "command": "autopipe plan " + " ".join(argv),
        "seconds": round(seconds, 1),
        "peak_memory_gib": round(int(peak.group(1)) / (1 << 20), 2) if peak else None,
        "exit": done.returncode,
        "step": step.group(1) if step else None,
        "balance": balance.group(1) if balance else None,
        "error": error,
        "ranked": ranked,
    }


def render(results: dict[str, dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    rows = [
        "| case | seconds | peak memory | outcome |",
        "|---|---:|---:|---|",
    ]
    for name, r in results.items():
        if r["error"]:
            outcome = r["error"].removeprefix("autopipe: error: ")
        else:
            outcome = f"step {r['step']}, balance {r['balance']}"
        rows.append(f"| {name} | {r['seconds']} | {r['peak_memory_gib']} GiB | {outcome} |")
    commands = [f"- {name}: `{r['command']}`" for name, r in results.items()]
    return "\n".join([*rows, "", *commands]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES)
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {', '.join(CASES)}")
    results = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        results[name] = run_case(CASES[name])
        r = results[name]
        print(f"  {r['seconds']} s, {r['peak_memory_gib']} GiB, exit {r['exit']}", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"host": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    (args.out / "giant.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=2))
    table = render(results)
    (args.out / "giant.md").write_text("# Planning giant models on this host\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
