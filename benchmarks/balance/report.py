"""The Markdown report of the balance suite, rendered from its JSON results alone."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["MEMORY_LABEL", "noise_summary", "render"]

MEMORY_LABEL = "optimal (memory)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _pct(x: float) -> str:
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"


def _list(values: list[float], scale: float, digits: int) -> str:
    return " / ".join(f"{v * scale:.{digits}f}" for v in values)


def _row(m: dict[str, Any], stages: int, label: str) -> dict[str, Any] | None:
    return next((r for r in m["rows"] if r["stages"] == stages and r["strategy"] == label), None)


def _intro(results: dict[str, Any]) -> list[str]:
    machine = results["machine"]
    noise = results["noise"]
    chunks = results["chunks"]
    load = machine["load_average"]
    return [
        "# Balance on the model zoo: predicted and measured",
        "",
        f"Machine: {machine['cpus']} CPUs ({machine.get('cpu', '?')}, {machine['platform']}), "
        f"Python {machine['python']}, "
        f"torch {machine['torch']}, {machine['threads']} torch thread; "
        f"{results['mode']} run of {', '.join(m['model'] for m in results['models'])} "
        f"for K = {', '.join(str(k) for k in results['stages'])} "
        f"({results['wall_seconds']:.0f} s in all). 1-minute load average "
        f"{load['start']:.2f} at the start and {load['end']:.2f} at the end (the machine is "
        "shared: other work ran alongside).",
        "",
        f"Each model is cut into units, profiled once ({results['profile_repeats']} timed runs "
        f"per layer, M={chunks} micro-batches of its sample batch) and planned with "
        "checkpointing `except_last` and Adam's optimizer state. *Measured* stage times run "
        "each planned stage alone on its micro-batch inputs: forward + backward from "
        "ones-like output gradients, plus a no-grad re-computation forward weighted by the "
        f"share of micro-batches the stage checkpoints ((M-1)/M = {(chunks - 1) / chunks:.2f} "
        "under `except_last`). All distinct stages of a model (every K, every strategy) are "
        f"timed round-robin, {results['repeats']} rounds of one run each after a warm-up, so "
        "a change in machine load hits every stage alike; a stage's time is the median "
        "over the rounds. Transfers are free on one CPU and not measured.",
        "",
        f"**Noise.** The spread of a measurement is its interquartile range over the rounds "
        f"relative to its median. Over the {noise['count']} measured stages: median spread "
        f"{_pct(noise['median'])}, 90th percentile {_pct(noise['p90'])}, largest "
        f"{_pct(noise['max'])}. Ratios of measured bottlenecks closer to 1 than about the "
        "spread of the two stages behind them are ties, not wins.",
        "",
        f"`{MEMORY_LABEL}` is the optimal plan under a per-device memory limit chosen per "
        "model and K to bind but fit: bisection on the capacity (calling the planner, which "
        "raises `PlanningError` when no split fits) finds the least capacity at which any "
        f"split fits; the limit is {results['margin']} x that, or the midpoint between it "
        "and the unconstrained optimal plan's peak stage memory when that is lower, so the "
        "unconstrained optimal split never fits under it. Memory is the planner's own "
        "per-stage figure: parameters + gradients + optimizer state + buffers + boundary "
        "inputs + saved activations.",
        "",
    ]


def _headline(results: dict[str, Any], labels: list[str], k: int) -> list[str]:
    lines = [f"## Measured bottleneck / optimal's measured bottleneck, K={k}", ""]
    lines += ["| model | " + " | ".join(labels) + " |", "|---" + "|---:" * len(labels) + "|"]
    for m in results["models"]:
        cells = []
        for label in labels:
            row = _row(m, k, label)
            if row is None:
                cells.append("-")
            elif not row.get("applies", True):
                cells.append("n/a")
            elif not row["fits"]:
                cells.append("does not fit")
            else:
                cells.append(f"{row['measured_ratio']:.2f}")
        lines.append(f"| {m['model']} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _memory(results: dict[str, Any]) -> list[str]:
    lines = ["## Memory-aware optimal: the limit and what it costs", ""]
    lines += [
        "| model | K | least feasible | limit | unconstrained peak | optimal balance | "
        "balance under the limit | stage memory under the limit (MiB) | predicted step / "
        "optimal | measured bottleneck / optimal |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    notes = []
    for m in results["models"]:
        for k, limit in m["memory_limits"].items():
            best, row = _row(m, int(k), "optimal"), _row(m, int(k), MEMORY_LABEL)
            if best is None or row is None:
                continue
            head = (
                f"| {m['model']} | {k} | {_mib(limit['least'])} | {_mib(limit['limit'])} | "
                f"{_mib(limit['unconstrained_peak'])} | {best['balance']} |"
            )
            if not row["fits"]:
                lines.append(f"{head} does not fit | | | |")
                continue
            lines.append(
                f"{head} {row['balance']} | {_list(row['stage_memory'], 2**-20, 2)} | "
                f"{row['predicted_step'] / best['predicted_step']:.3f} | "
                f"{row['measured_ratio']:.2f} |"
            )
            if not limit["binding"]:
                notes.append(f"{m['model']} K={k}")
    if notes:
        lines += [
            "",
            f"Not binding for {', '.join(notes)}: the unconstrained optimal split already "
            "needs the least memory of any split, so no feasible limit excludes it; the "
            "limit shown is that least capacity.",
        ]
    return [*lines, ""]


def _planning(results: dict[str, Any], labels: list[str]) -> list[str]:
    lines = ["## Planning time per strategy (ms)", ""]
    lines += [
        "One planner call each; `limit search` is the whole bisection for the memory limit "
        "(one unconstrained plan plus one plan per probe, count in brackets).",
        "",
        "| model | K | " + " | ".join(labels) + " | limit search |",
        "|---|---:" + "|---:" * (len(labels) + 1) + "|",
    ]
    for m in results["models"]:
        for k, seconds in m["planning_seconds"].items():
            cells = [f"{seconds[label] * 1e3:.1f}" for label in labels]
            limit = m["memory_limits"][k]
            cells.append(f"{limit['seconds'] * 1e3:.0f} ({limit['probes']})")
            lines.append(f"| {m['model']} | {k} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _plans(results: dict[str, Any]) -> list[str]:
    lines = ["## Every plan", ""]
    lines += [
        "Per-stage lists run stage 0 first. *Spread* is the bottleneck stage's interquartile "
        "range relative to its median.",
        "",
        "| model | K | strategy | balance | predicted bottleneck | predicted step | "
        "stage memory (MiB) | measured per stage (ms) | measured bottleneck | spread | "
        "predicted / optimal | measured / optimal |",
        "|---|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for m in results["models"]:
        for r in m["rows"]:
            head = f"| {m['model']} | {r['stages']} | {r['strategy']} |"
            if not r.get("applies", True):
                lines.append(f"{head} n/a (not the model's shape) |" + " |" * 10)
                continue
            if not r["fits"]:
                lines.append(f"{head} does not fit in {_mib(r['capacity'])} |" + " |" * 10)
                continue
            lines.append(
                f"{head} {r['balance']} | {_ms(r['predicted_bottleneck'])} | "
                f"{_ms(r['predicted_step'])} | {_list(r['stage_memory'], 2**-20, 2)} | "
                f"{_list(r['measured_stage_times'], 1e3, 2)} | "
                f"{_ms(r['measured_bottleneck'])} | {_pct(r['measured_bottleneck_spread'])} | "
                f"{r['predicted_ratio']:.3f} | {r['measured_ratio']:.3f} |"
            )
    return [*lines, ""]


def _table2(results: dict[str, Any]) -> list[str]:
    stages = [2, 4, 8]
    ms = results["table2_chunks"]
    lines = ["## GPipe Table 2 in our terms: normalized throughput", ""]
    lines += [
        "**These are predictions from CPU profiles of tiny models, not TPU measurements.** "
        "Throughput(K, M) = M x micro-batch / predicted step time, with the micro-batch fixed "
        f"at the profiled one (batch / {results['chunks']}), normalized by the same split's "
        "K=2, M=1 value. GPipe's numbers are the paper's TPU measurements (Huang et al., "
        "2019, Table 2).",
        "",
    ]
    header = "| model | split | " + " | ".join(f"K={k} M={m}" for k in stages for m in ms)
    lines += [header + " |", "|---|---" + "|---:" * (len(stages) * len(ms)) + "|"]
    for paper, table in results["gpipe_table2"].items():
        cells = [f"{v:.2f}" for k in stages for v in table[str(k)]]
        lines.append(f"| {paper} (GPipe, TPU) | paper | " + " | ".join(cells) + " |")
    for m in results["models"]:
        for split, table in m["table2"].items():
            cells = ["-" if v is None else f"{v:.2f}" for k in stages for v in table[str(k)]]
            lines.append(f"| {m['model']} | {split} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _pictures(results: dict[str, Any], k: int) -> list[str]:
    lines: list[str] = []
    bars = [(m["model"], m["pictures"].get("bars")) for m in results["models"]]
    if any(p for _, p in bars):
        lines += [f"## Stage bars, K={k} (predicted time per micro-batch, by strategy)", ""]
        lines += [f"![{name}: stage times per strategy]({p})" for name, p in bars if p]
        lines.append("")
    timelines = [(m["model"], m["pictures"].get("timeline")) for m in results["models"]]
    if any(p for _, p in timelines):
        lines += [
            f"## Pipeline timelines, optimal split, K={k}, M={results['chunks']}",
            "",
            "One simulated training step per model (GPipe fill-drain, `except_last`): one row "
            "per stage, forwards, re-computations and backwards in their colours, bubbles as "
            "gaps.",
            "",
        ]
        lines += [f"![{name}: pipeline timeline]({p})" for name, p in timelines if p]
        lines.append("")
    return lines


def noise_summary(models: list[dict[str, Any]]) -> dict[str, float]:
    """Spread (IQR / median) of every distinct measured stage, summarized over the run.

    Args:
        models: the per-model records of a run (``results["models"]``).

    Returns:
        ``count`` of distinct stages and the ``median``, ``p90`` and ``max`` spread.
    """
    # Keyed by the stage's layer range: a stage shared by several plans counts once.
    spreads = {
        (m["model"], sum(r["balance"][:i]), sum(r["balance"][: i + 1])): t["spread"]
        for m in models
        for r in m["rows"]
        if r["fits"]
        for i, t in enumerate(r["measured_stage_timings"])
    }
    values = sorted(spreads.values())
    if not values:
        return {"count": 0, "median": 0.0, "p90": 0.0, "max": 0.0}
    return {
        "count": len(values),
        "median": statistics.median(values),
        "p90": values[min(len(values) - 1, int(0.9 * len(values)))],
        "max": values[-1],
    }


def render(results: dict[str, Any]) -> str:
    """The Markdown report of a balance-suite run.

    Args:
        results: the run's JSON object as ``benchmarks.balance.suite`` writes it.

    Returns:
        The report; pictures are referenced by file name, next to the report.
    """
    labels = list(results["labels"])
    k = results["picture_stages"]
    lines = _intro(results)
    lines += _headline(results, labels, k)
    lines += _memory(results)
    lines += _planning(results, labels)
    lines += _plans(results)
    lines += _table2(results)
    lines += _pictures(results, k)
    return "\n".join(lines).rstrip("\n") + "\n"
