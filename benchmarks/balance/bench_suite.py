"""``autopipe bench`` over models with unbalanced costs: each strategy's measured step.

Run: ``python -m benchmarks.balance.bench_suite [--quick] [--models a,b] [--out DIR]``. For
each model (the zoo's resnet, unet and gpt2, a Hugging Face Llama with an untied 16k head,
and examples/gpt2.py) and each setting (K = 2 on two CPU-bound gloo ranks, K = 2 and 4 on
the single-process GPipe), it runs ``autopipe bench --json`` as a subprocess with the
strategies optimal, uniform, parameters and blockpartition, and writes one table,
``bench_suite.{json,md}``, to ``benchmarks/results/`` or ``--out``: each strategy's median
step relative to optimal's, optimal's measured / ideal, whether optimal is no slower than
every other strategy (within the measured spread) and, where it is more than 10% above the
ideal, the unit the bench summary says bounds it. ``--models`` takes names of
:data:`MODELS` or paths of model files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.balance.bench_table import render, row_of
from benchmarks.processes import ROOT, rerun_with_stable_malloc, run_autopipe

RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ("optimal", "uniform", "parameters", "blockpartition")
MODELS: dict[str, str] = {
    "resnet": "benchmarks/models/resnet.py",
    "unet": "benchmarks/models/unet.py",
    "gpt2": "benchmarks/models/gpt2.py",
    "llama-untied": "benchmarks/models/llama_untied.py",
    "hf-gpt2": "examples/gpt2.py",
}
# Few steps keep the whole suite (5 models x 3 settings) near 15 minutes on 2 cores; the
# splits take turns step by step, so a slow spell touches every strategy alike. The later
# half of the warm-up (7 rounds) gives the in-place figures the predictions come from:
# on ranks 3 recorded steps and 4 unrecorded ones, whose medians a shared host's odd slow
# step moves less than it moved the 2 and 2 of 7 rounds.
STEPS, WARMUP = 8, 13
QUICK_STEPS, QUICK_WARMUP = 2, 1
TIMEOUT = 900  # seconds per run: a hung rank fails its row, not the suite


@dataclass(frozen=True)
class Setting:
    """One way of running the splits: ``stages`` on ``ranks`` processes or in one."""

    stages: int
    ranks: int | None

    @property
    def label(self) -> str:
        """``K=2, 2 ranks`` or ``K=4, GPipe``."""
        where = f"{self.ranks} gloo ranks" if self.ranks else "GPipe"
        return f"K={self.stages}, {where}"


SETTINGS = (Setting(2, 2), Setting(2, None), Setting(4, None))


def _command(
    path: str, setting: Setting, quick: bool, out: Path, recalibrate: bool = False
) -> list[str]:
    command = ["bench", path, "--device", "cpu"]
    command += ["--stages", str(setting.stages), "--strategies", ",".join(STRATEGIES)]
    if setting.ranks:
        command += ["--ranks", str(setting.ranks)]
        if recalibrate:  # the suite's first run on ranks measures the runner afresh
            command.append("--recalibrate")
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if quick else (STEPS, WARMUP)
    command += ["--steps", str(steps), "--warmup", str(warmup), "--json", str(out)]
    if quick:
        command += ["--profile-repeats", "1", "--profile-warmup", "0"]
    return command


def run_one(
    name: str, path: str, setting: Setting, quick: bool, recalibrate: bool = False
) -> dict[str, Any]:
    """One ``autopipe bench`` run as a table row; a failed run is a row with its error."""
    with tempfile.TemporaryDirectory() as workdir:
        out = Path(workdir) / "bench.json"
        begin = time.perf_counter()
        try:
            done = run_autopipe(_command(path, setting, quick, out, recalibrate), TIMEOUT)
        except subprocess.TimeoutExpired:
            return {"model": name, "setting": setting.label, "error": f"over {TIMEOUT} s"}
        seconds = time.perf_counter() - begin
        if done.returncode != 0 or not out.exists():
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return {"model": name, "setting": setting.label, "error": lines[-1]}
        record = json.loads(out.read_text())
    row = row_of(record, STRATEGIES)
    row.update(model=name, setting=setting.label, seconds=seconds)
    return row


def machine_record() -> dict[str, Any]:
    """The host a benchmark ran on: platform, processor, CPUs and the load before it."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def chosen_models(text: str | None, default: tuple[str, ...] = ()) -> dict[str, str]:
    """The models ``--models`` names (of :data:`MODELS`, or model files); without it,
    ``default`` (every one when empty)."""
    if not text:
        return {name: MODELS[name] for name in default or MODELS}
    chosen: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        if item in MODELS:
            chosen[item] = MODELS[item]
        elif item.endswith(".py") and Path(item).exists():
            chosen[Path(item).stem] = str(Path(item).resolve())
        else:
            raise SystemExit(
                f"unknown model {item!r}: choose from {', '.join(MODELS)} or give a model file"
            )
    return chosen


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the suite and writes ``bench_suite.{json,md}``; returns the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, 1 profile run")
    parser.add_argument("--models", help=f"comma-separated: {', '.join(MODELS)} or .py files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    models = chosen_models(args.models)
    machine = machine_record()
    runs = [(name, path, setting) for name, path in models.items() for setting in SETTINGS]
    rows = []
    begin = time.perf_counter()
    for index, (name, path, setting) in enumerate(runs, 1):
        print(f"[{index}/{len(runs)}] {name}, {setting.label} ...", file=sys.stderr, flush=True)
        first_on_ranks = bool(setting.ranks) and not any(s.ranks for _, _, s in runs[: index - 1])
        row = run_one(name, path, setting, args.quick, recalibrate=first_on_ranks)
        note = row.get("error") or f"done in {row['seconds']:.0f} s"
        print(f"[{index}/{len(runs)}] {name}, {setting.label}: {note}", file=sys.stderr)
        rows.append(row)
    machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if args.quick else (STEPS, WARMUP)
    record = {
        "machine": machine,
        "settings": {"steps": steps, "warmup": warmup, "strategies": list(STRATEGIES)},
        "seconds": time.perf_counter() - begin,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_suite.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "bench_suite.md").write_text(render(record, STRATEGIES))
    print(f"results written to {args.out}/bench_suite.{{json,md}}", file=sys.stderr)
    return record


if __name__ == "__main__":
    rerun_with_stable_malloc("benchmarks.balance.bench_suite")
    main()
