"""The pipeline schedules measured on ranks: 1F1B, interleaved 1F1B, ZBV and DualPipeV.

Run: ``python -m benchmarks.distributed.schedule_bench [--quick] [--models a,b] [--out DIR]``.
For each model (by default the bench suite's Llama with an untied 16k head, whose head
outweighs several blocks; ``--models llama-untied,gpt2`` adds the zoo's gpt2, another
four runs of about two minutes each on a shared 2-core host) it runs ``autopipe bench
--json`` as a subprocess on two CPU-bound gloo ranks, M = 8, once per schedule —
``1f1b`` (2 stages), interleaved ``1f1b`` with 2 virtual stages per rank, ``zbv`` and
``dualpipev`` (4 stages, 2 per rank, rank r holding r and 3−r) — with the ``optimal``
split and ``uniform`` for reference, every schedule without re-computation (``--checkpoint
never``, the only mode of the V schedules), and writes ``schedule_bench.{json,md}`` to
``benchmarks/results/`` or ``--out`` (after every run): per schedule and split the measured
step (median and interquartile spread), the prediction and measured / predicted, where
the prediction came from (the warm-up steps timed in place, or the profile), and the step
relative to 1F1B's of the same strategy.

Each schedule is its own ``autopipe bench`` run (profiled on the ranks, the runner
calibrated afresh for its runtime — torch runs several stages per rank on its multi-stage
runtime — and predicted from its own warm-up steps), so schedules are compared across
runs taken one after another: a slow spell of a shared host shows in one schedule alone.
The splits within a run take turns step by step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.balance.bench_suite import chosen_models, machine_record
from benchmarks.processes import ROOT, rerun_with_stable_malloc, run_autopipe

RESULTS = ROOT / "benchmarks" / "results"
STRATEGIES = ("optimal", "uniform")
MODELS: dict[str, str] = {
    "llama-untied": "benchmarks/models/llama_untied.py",
    "gpt2": "benchmarks/models/gpt2.py",
}
# The models run unless --models says otherwise: four runs of one model stay near 10 minutes.
DEFAULT_MODELS = ("llama-untied",)
RANKS, CHUNKS = 2, 8
# Few steps keep a model's four runs near five minutes on 2 shared cores; the warm-up
# steps' later half times the stages in place for the predictions.
STEPS, WARMUP, PROFILE_REPEATS = 5, 4, 5
QUICK_STEPS, QUICK_WARMUP = 2, 2
TIMEOUT = 900  # seconds per run: a hung rank fails its row, not the benchmark


@dataclass(frozen=True)
class Schedule:
    """One schedule as ``autopipe bench`` takes it: the name and stages per rank."""

    name: str
    virtual_stages: int | None = None

    @property
    def label(self) -> str:
        """``1f1b``, ``interleaved 1f1b (v=2)``, ``zbv``."""
        if self.virtual_stages:
            return f"interleaved {self.name} (v={self.virtual_stages})"
        return self.name

    def options(self) -> list[str]:
        """The bench options that select it."""
        extra = ["--virtual-stages", str(self.virtual_stages)] if self.virtual_stages else []
        return ["--schedule", self.name, *extra]


SCHEDULES = (Schedule("1f1b"), Schedule("1f1b", 2), Schedule("zbv"), Schedule("dualpipev"))
BASELINE = SCHEDULES[0]


def _command(path: str, schedule: Schedule, quick: bool, out: Path) -> list[str]:
    command = ["bench", path, "--device", "cpu"]
    command += ["--ranks", str(RANKS), "--chunks", str(CHUNKS), *schedule.options()]
    command += ["--strategies", ",".join(STRATEGIES), "--json", str(out)]
    # The V schedules keep every activation; so does every schedule here, so that they
    # differ in their order alone (1F1B would re-compute by default: except_last).
    command += ["--checkpoint", "never"]
    # Each schedule's runtime measured afresh: the cache may hold another day's figures.
    command.append("--recalibrate")
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if quick else (STEPS, WARMUP)
    command += ["--steps", str(steps), "--warmup", str(warmup)]
    repeats = 1 if quick else PROFILE_REPEATS
    command += ["--profile-repeats", str(repeats), "--profile-warmup", "1"]
    return command


def _source(in_place: str) -> str:
    """Where the predictions came from, in a word or two."""
    if in_place.startswith("predicted from in-place figures of a second run"):
        return "in place, 2nd run"
    if in_place.startswith("predicted from in-place"):
        return "in place"
    return "profile"


def row_of(record: dict[str, Any]) -> dict[str, Any]:
    """One schedule's row of an ``autopipe bench --json`` record: per strategy its split
    and step figures."""
    settings = record["settings"]
    return {
        "stages": settings["stages"],
        "stages_per_rank": settings.get("stages_per_rank", 1),
        "chunks": settings["chunks"],
        "checkpoint": settings["checkpoint"],
        "source": _source(settings.get("in_place") or ""),
        "in_place": settings.get("in_place") or "",
        "calibrated": settings.get("calibrated", ""),
        "strategies": {
            split["label"]: {
                "balance": split["balance"],
                "measured": split["measured"],
                "spread": split["spread"],
                "predicted": split["predicted"],
                "over_predicted": split["measured_over_predicted"],
                "times": split["times"],
            }
            for split in record["splits"]
            if split["label"] in STRATEGIES
        },
    }


def run_one(name: str, path: str, schedule: Schedule, quick: bool) -> dict[str, Any]:
    """One ``autopipe bench`` run as a row; a failed run is a row with its error."""
    base = {"model": name, "schedule": schedule.label}
    with tempfile.TemporaryDirectory() as workdir:
        out = Path(workdir) / "bench.json"
        begin = time.perf_counter()
        try:
            done = run_autopipe(_command(path, schedule, quick, out), TIMEOUT)
        except subprocess.TimeoutExpired:
            return {**base, "error": f"over {TIMEOUT} s"}
        seconds = time.perf_counter() - begin
        if done.returncode != 0 or not out.exists():
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return {**base, "error": lines[-1]}
        record = json.loads(out.read_text())
    return {**base, **row_of(record), "seconds": seconds}


def add_relative(rows: list[dict[str, Any]]) -> None:
    """Each row's strategies' step over the same model's and strategy's under 1F1B
    (``vs_1f1b``; absent where either run failed)."""
    base = {row["model"]: row for row in rows if row["schedule"] == BASELINE.label}
    for row in rows:
        reference = base.get(row["model"])
        if "error" in row or reference is None or "error" in reference:
            continue
        for label, entry in row["strategies"].items():
            if label in reference["strategies"]:
                entry["vs_1f1b"] = entry["measured"] / reference["strategies"][label]["measured"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _cells(entry: dict[str, Any] | None) -> list[str]:
    if entry is None:
        return ["-"] * 5
    relative = entry.get("vs_1f1b")
    return [
        f"{entry['balance']}",
        f"{_ms(entry['measured'])} ±{entry['spread']:.0%}",
        _ms(entry["predicted"]),
        f"{entry['over_predicted']:.2f}",
        "-" if relative is None else f"{relative:.2f}x",
    ]


def render(record: dict[str, Any]) -> str:
    """The markdown table of a run: one row per model and schedule."""
    machine, settings = record["machine"], record["settings"]
    load = ", ".join(f"{x:.2f}" for x in machine["load_average"])
    after = ", ".join(f"{x:.2f}" for x in machine["load_average_after"])
    lines = [
        "# Pipeline schedules measured on ranks: 1F1B, interleaved 1F1B, ZBV, DualPipeV",
        "",
        f"Machine: {machine['processor']}, {machine['cpus']} CPUs, {machine['platform']}; "
        f"load average (1, 5, 15 min) {load} before, {after} after, this run's own ranks "
        "included: other work shared the host, so read differences under the spread as "
        f"noise. {settings['ranks']} gloo ranks, each bound to its own CPUs; M = "
        f"{settings['chunks']}, no re-computation (checkpoint never); "
        f"{settings['steps']} timed steps per split after "
        f"{settings['warmup']} warm-up, the splits of a run taking turns; SGD, loss the mean "
        f"of the output. Whole run {record['seconds'] / 60:.1f} min.",
        "",
        "Each schedule is one `autopipe bench --ranks 2 --schedule S --json` run: profiled "
        "on the ranks, the runner calibrated afresh for its runtime (several stages per "
        "rank run on torch's multi-stage runtime) and predicted from its own warm-up steps "
        "timed in place (*pred from*: `in place`; `profile` where they could not be). "
        "*measured*: median step ± the interquartile range over the median. *vs 1f1b*: the "
        "median step over 1F1B's for the same strategy, runs taken one after another. "
        "`uniform` over 4 stages is DeepSpeed's partition_uniform applied to 4 stages, a "
        "split DeepSpeed itself never runs (it has no such schedule).",
        "",
        "| model | schedule | stages | pred from | optimal split | measured | predicted | "
        "meas/pred | vs 1f1b | uniform split | measured | predicted | meas/pred | vs 1f1b |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in record["rows"]:
        if "error" in row:
            cells = [row["model"], row["schedule"], "-", f"failed: {row['error']}"]
            lines.append("| " + " | ".join(cells + ["-"] * 10) + " |")
            continue
        strategies = row["strategies"]
        stages = f"{row['stages']} ({row['stages_per_rank']}/rank)"
        cells = [row["model"], row["schedule"], stages, row["source"]]
        optimal, uniform = strategies.get("optimal"), strategies.get("uniform")
        cells += _cells(optimal) + _cells(uniform)
        if optimal and uniform and optimal["balance"] == uniform["balance"]:
            cells[9] += " (optimal's: measured once)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every model under every schedule and writes ``schedule_bench.{json,md}``;
    returns the JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps, 1 profile run")
    parser.add_argument("--models", help=f"comma-separated: {', '.join(MODELS)} or .py files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    models = chosen_models(args.models, DEFAULT_MODELS)
    machine = machine_record()
    runs = [(name, path, schedule) for name, path in models.items() for schedule in SCHEDULES]
    rows: list[dict[str, Any]] = []
    steps, warmup = (QUICK_STEPS, QUICK_WARMUP) if args.quick else (STEPS, WARMUP)
    record = {
        "machine": machine,
        "settings": {
            "ranks": RANKS,
            "chunks": CHUNKS,
            "checkpoint": "never",
            "steps": steps,
            "warmup": warmup,
            "strategies": list(STRATEGIES),
            "schedules": [schedule.label for schedule in SCHEDULES],
        },
        "seconds": 0.0,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    begin = time.perf_counter()
    for index, (name, path, schedule) in enumerate(runs, 1):
        print(f"[{index}/{len(runs)}] {name}, {schedule.label} ...", file=sys.stderr, flush=True)
        row = run_one(name, path, schedule, args.quick)
        note = row.get("error") or f"done in {row['seconds']:.0f} s"
        print(f"[{index}/{len(runs)}] {name}, {schedule.label}: {note}", file=sys.stderr)
        rows.append(row)
        # Written after every run: an interrupted benchmark keeps what it measured.
        add_relative(rows)
        machine["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        record["seconds"] = time.perf_counter() - begin
        (args.out / "schedule_bench.json").write_text(json.dumps(record, indent=2) + "\n")
        (args.out / "schedule_bench.md").write_text(render(record))
    print(f"results written to {args.out}/schedule_bench.{{json,md}}", file=sys.stderr)
    return record


if __name__ == "__main__":
    rerun_with_stable_malloc("benchmarks.distributed.schedule_bench")
    main()
