"""The report and picture of benchmarks/planning/estimates.py, rendered from its JSON alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["draw", "held", "render"]

LABELS = {"fitted": "fitted efficiency", "default": "default efficiency"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.1 else f"{x:.1%}"


def _row(m: dict[str, Any], stages: int, source: str) -> dict[str, Any] | None:
    return next((r for r in m["rows"] if r["stages"] == stages and r["source"] == source), None)


def held(ratio: float, goal: float) -> bool:
    """Whether the estimate's split is at most ``goal`` slower than the measured one's."""
    return ratio <= 1 + goal


def _cell(row: dict[str, Any] | None, key: str, goal: float, quartiles: bool = True) -> str:
    if row is None:
        return "-"
    if row["same_as_measured"]:
        return "same split"
    ratio = row[key]
    text = f"{ratio:.3f}" + ("" if held(ratio, goal) else " ✗")
    spread = row.get(f"{key}_spread")
    if quartiles and spread:
        text += f" [{spread['q1']:.2f}, {spread['q3']:.2f}]"
    return text


def _intro(results: dict[str, Any]) -> list[str]:
    machine, device = results["machine"], results["device"]
    figures = device["figures"]
    e = results["default_efficiency"]
    load = machine["load_average"]
    models = ", ".join(m["model"] for m in results["models"])
    return [
        "# Estimated layer times on the CPU, and the splits planned from them",
        "",
        f"Machine: {machine['cpus']} CPUs ({device['name']}, {machine['platform']}), Python "
        f"{machine['python']}, torch {machine['torch']}, {machine['threads']} torch thread; "
        f"{results['mode']} run of {models} ({results['wall_seconds']:.0f} s in all); 1-minute "
        f"load average {load['start']:.2f} at the start, {load['end']:.2f} at the end (the "
        "machine is shared: other work ran alongside).",
        "",
        f"The CPU as a catalog device (`measure_peaks` → `measured_device`, key "
        f"`{device['key']}`): float32 matmul peak "
        f"{figures['peak_flops']['float32'] / 1e9:.1f} GFLOP/s, copy bandwidth "
        f"{figures['memory_bandwidth'] / 1e9:.1f} GB/s, memory {figures['memory'] / 2**30:.1f} "
        "GiB.",
        "",
        "Each model is profiled once (real times with counted FLOPs and bytes, "
        f"M={results['chunks']} micro-batches) and its times estimated from the counts with "
        f"the default efficiencies (η_f {e['compute']}, η_m {e['memory']}, overhead "
        f"{e['overhead'] * 1e6:.0f} µs, set for GPUs) and with efficiencies fitted to the "
        "measured profile. A unit's error is |estimated − measured| / measured of its "
        "forward + backward, the largest over the profiled batch sizes (as the fit reports "
        "it); the unit tables and the picture give the micro-batch size's times. K = "
        f"{', '.join(str(k) for k in results['stages'])} stages are planned (GPipe schedule, "
        "`except_last` checkpointing) from each profile.",
        "",
        "*Measured step*: whole training steps (forward, mean loss, backward) of the GPipe "
        "executor with every stage on the CPU; all distinct splits of a model run "
        f"round-robin in a new order each round, {results['warmup']} warm-up rounds dropped, "
        f"median of {results['repeats']} rounds (fewer for a model of slow steps, as its "
        "section says; spread: interquartile range / median). One "
        "CPU runs the stages one after another, so a step is the sum of the stages plus the "
        "re-computation, nearly the same for every split: its ratio shows that an estimate's "
        "split costs nothing on this executor, not that it balances. *Measured bottleneck*: "
        "each stage timed alone on its micro-batch (forward + backward + its share of "
        "re-computation, round-robin), the slowest stage, the one a pipeline of K devices "
        "waits for every micro-batch. A measured ratio is the estimate's split over the "
        "measured profile's split, the median of the per-round ratios (both splits ran in "
        "every round), with its quartiles in brackets; the goal is at most "
        f"{1 + results['goal']:.2f} (✗ marks a median above it). A ratio whose quartiles "
        "straddle 1 is a tie within the machine's noise. *Predicted ratio*: the same ratio "
        "by the measured profile's own costs (`evaluate` of each split on it), free of "
        "timing noise at benchmark time: what choosing the estimate's split costs by the "
        "profile the planner would have had.",
        "",
    ]


def _summary(results: dict[str, Any]) -> list[str]:
    goal = results["goal"]
    lines = [
        "## Summary",
        "",
        "| model | units | fitted η_f / η_m / overhead | unit error, fitted (median / max) | "
        "unit error, default (median / max) |",
        "|---|---:|---|---:|---:|",
    ]
    for m in results["models"]:
        e, fit, default = (
            m["fit"]["efficiency"],
            m["unit_errors"]["fitted"],
            m["unit_errors"]["default"],
        )
        lines.append(
            f"| {m['model']} | {m['units']} | {e['compute']:.3g} / {e['memory']:.3g} / "
            f"{e['overhead'] * 1e6:.0f} µs | {_pct(fit['median'])} / {_pct(fit['max'])} | "
            f"{_pct(default['median'])} / {_pct(default['max'])} |"
        )
    columns = [(k, s) for k in results["stages"] for s in ("fitted", "default")]
    head = " | ".join(f"K={k} {s}" for k, s in columns)
    titles = (
        ("step_ratio", "Measured step"),
        ("bottleneck_ratio", "Measured bottleneck"),
        ("predicted_ratio", "Predicted step (measured profile)"),
    )
    for key, title in titles:
        lines += [
            "",
            f"{title} of the estimate's split / of the measured profile's split:",
            "",
            f"| model | {head} |",
            "|---" + "|---:" * len(columns) + "|",
        ]
        for m in results["models"]:
            cells = [_cell(_row(m, k, s), key, goal) for k, s in columns]
            lines.append(f"| {m['model']} | " + " | ".join(cells) + " |")
        lines += ["", _tally(results, key)]
    return [*lines, ""]


def _tally(results: dict[str, Any], key: str) -> str:
    """How many estimated splits met the goal, and how many misses are ties."""
    goal = results["goal"]
    rows = [
        r
        for m in results["models"]
        for r in m["rows"]
        if r["source"] != "measured" and r["stages"] in results["stages"]
    ]
    same = sum(r["same_as_measured"] for r in rows)
    other = [r for r in rows if not r["same_as_measured"]]
    missed = [r for r in other if not held(r[key], goal)]
    ties = [r for r in missed if r.get(f"{key}_spread") and r[f"{key}_spread"]["q1"] <= 1]
    text = (
        f"Of {len(rows)} estimated splits, {same} are the measured profile's own; of the "
        f"other {len(other)}, {len(other) - len(missed)} are within {goal:.0%}"
    )
    if ties:
        text += f"; of the {len(missed)} misses, {len(ties)} are ties (their quartiles reach 1)"
    return text + "."


def _model(m: dict[str, Any], goal: float) -> list[str]:
    lines = [
        f"## {m['model']}",
        "",
        f"{m['units']} units, batch {m['batch']} (micro-batch {m['micro_batch']}), profiled in "
        f"{m['profile_seconds']:.1f} s, {m['repeats']} timed rounds. {m['fit']['summary']}.",
        "",
        "| K | profile | balance | predicted step (own profile) | predicted step (measured "
        "profile) | measured step (spread) | step ratio | measured bottleneck (spread) | "
        "bottleneck ratio |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in m["rows"]:
        same = " (= measured)" if r["same_as_measured"] and r["source"] != "measured" else ""
        lines.append(
            f"| {r['stages']} | {r['source']} | {r['balance']}{same} | "
            f"{_ms(r['predicted_step'])} ms | {_ms(r['measured_profile_step'])} ms | "
            f"{_ms(r['step']['median'])} ms ({_pct(r['step']['spread'])}) | "
            f"{_cell(r, 'step_ratio', goal) if r['source'] != 'measured' else '1'} | "
            f"{_ms(r['bottleneck']['median'])} ms ({_pct(r['bottleneck']['spread'])}) | "
            f"{_cell(r, 'bottleneck_ratio', goal) if r['source'] != 'measured' else '1'} |"
        )
    lines += [
        "",
        "<details><summary>Unit times: forward + backward at the micro-batch size (ms)</summary>",
        "",
        "| unit | kind | measured | fitted (error) | default (error) |",
        "|---|---|---:|---:|---:|",
    ]
    for u in m["layers"]:
        cells = []
        for label in ("fitted", "default"):
            error = u[f"{label}_error"]
            cells.append(f"{_ms(u[label])} ({'-' if error is None else _pct(error)})")
        lines.append(f"| {u['name']} | {u['kind']} | {_ms(u['measured'])} | {' | '.join(cells)} |")
    return [*lines, "", "</details>", ""]


def render(results: dict[str, Any]) -> str:
    """The Markdown report: the device, a summary table, then one section per model."""
    lines = _intro(results) + _summary(results)
    for m in results["models"]:
        lines += _model(m, results["goal"])
    return "\n".join(lines)


def draw(results: dict[str, Any], path: Path) -> bool:
    """Estimated vs measured unit times, log-log, one colour per model, one panel per
    efficiency; returns whether it was drawn (``False`` without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), sharex=True, sharey=True)
    every = [
        v * 1e3
        for m in results["models"]
        for u in m["layers"]
        for v in (u["measured"], u["fitted"], u["default"])
        if v > 0
    ]
    low, high = min(every) / 1.5, max(every) * 1.5
    for ax, label in zip(axes, LABELS):
        for i, m in enumerate(results["models"]):
            pairs = [
                (u["measured"] * 1e3, u[label] * 1e3) for u in m["layers"] if u["measured"] > 0
            ]
            ax.scatter(*zip(*pairs), s=14, alpha=0.75, color=f"C{i}", label=m["model"])
        ax.plot([low, high], [low, high], color="black", linewidth=0.8)
        for factor in (0.5, 2.0):
            ax.plot(
                [low, high],
                [low * factor, high * factor],
                color="grey",
                linewidth=0.6,
                linestyle="--",
            )
        ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high))
        ax.set_xlabel("measured forward + backward per unit (ms)")
        ax.set_title(LABELS[label])
    axes[0].set_ylabel("estimated (ms)")
    axes[0].legend(fontsize=8)
    fig.suptitle("Estimated vs measured unit times on this CPU (dashed: ×2 and ×½)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
