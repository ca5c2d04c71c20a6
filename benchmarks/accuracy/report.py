"""Writes the Markdown report of benchmarks/accuracy/ranked_plans.py from its results."""

from __future__ import annotations

from typing import Any

__all__ = ["summary", "write_report"]

MB = 1e6
HEADER = (
    "| rank | K×D | M | checkpoint | schedule | predicted ms | measured ms | pred/meas | "
    "per run | predicted MB per stage | measured MB per stage | pred/meas |"
)


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Worst time and memory errors, and the first choice against the fastest measured."""
    times = [abs(r["time_ratio"] - 1) for r in rows]
    memory = [abs(x - 1) for r in rows for x in r["memory_ratio"]]
    fastest = min(r["measured_s"] for r in rows)
    return {
        "worst_time_error": max(times),
        "median_time_error": sorted(times)[len(times) // 2],
        "worst_memory_error": max(memory),
        "first_over_fastest": rows[0]["measured_s"] / fastest,
    }


def _row(rank: int, r: dict[str, Any]) -> str:
    schedule = r["schedule"] if r["stages"] > 1 else "-"
    memory = ", ".join(f"{x / MB:.1f}" for x in r["predicted_memory"])
    measured = ", ".join(f"{x / MB:.1f}" for x in r["measured_memory"])
    ratios = ", ".join(f"{x:.2f}" for x in r["memory_ratio"])
    runs = ", ".join(f"{x:.2f}" for x in r.get("runs_time_ratio", [r["time_ratio"]]))
    return (
        f"| {rank} | {r['stages']}×{r['data_parallel']} | {r['chunks']} | {r['checkpoint']} | "
        f"{schedule} | {r['predicted_s'] * 1e3:.2f} | {r['measured_s'] * 1e3:.2f} | "
        f"{r['time_ratio']:.2f} | {runs} | {memory} | {measured} | {ratios} |"
    )


def _table(title: str, rows: list[dict[str, Any]]) -> list[str]:
    s = summary(rows)
    lines = [f"#### {title}", "", HEADER, "|" + "---:|" * 12]
    lines += [_row(rank, r) for rank, r in enumerate(rows, start=1)]
    lines += [
        "",
        f"Step time: worst error {s['worst_time_error']:.0%}, median "
        f"{s['median_time_error']:.0%}. Memory: worst error {s['worst_memory_error']:.0%}. "
        f"The first choice measured {s['first_over_fastest']:.2f}× the fastest configuration.",
        "",
    ]
    return lines


def write_report(meta: dict[str, Any], results: dict[str, Any]) -> str:
    """The report's Markdown text."""
    load = ", ".join(f"{x:.1f}" for x in meta["load"])
    lines = [
        "# Planner accuracy: predicted vs measured",
        "",
        f"{meta.get('device', 'CPU')}, {meta['cpus']} CPUs, torch {meta['torch']}, Python "
        f"{meta['python']}, one "
        f"thread per process, medians of {meta['repeats']} interleaved steps; load average "
        f"at the end {load}. Step time is forward + backward of one mini-batch; memory per "
        "stage is parameters + gradients + Adam state + buffers + the peak of the bytes "
        "autograd holds for backward. Rank is the search's order (1 = its first choice). "
        "glibc malloc keeps freed memory (MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ "
        "raised), as a caching allocator does, so steps do not depend on the process's "
        "history. Profiles time each layer with cold caches (a scratch buffer is overwritten "
        "before each timed forward and backward)."
        + (
            f" Each of {meta['runs']} independent runs profiles, calibrates, searches and "
            "measures anew; the tables give, per configuration of the first run's ranking, "
            "the medians over the runs, and *per run* each run's pred/meas."
            if meta.get("runs", 1) > 1
            else ""
        ),
        "",
    ]
    for name, result in results.items():
        cal = result["calibration"]
        lines += [
            f"### {name}",
            "",
            f"Calibration: executor overhead {cal['overhead_s'] * 1e6:.0f} µs per stage and "
            f"micro-batch; in a whole step the layers take {cal['fixed_scale']:.2f}× their "
            f"profiled time per micro-batch and {cal['compute_scale']:.2f}× per sample.",
            "",
        ]
        lines += _table("One device: GPipe executor", result["one_device"])
        if "two_devices" in result:
            two = result["two_devices"]
            link = two["link"]
            lines += [
                f"Two ranks (gloo): link latency {link['latency_s'] * 1e6:.0f} µs, bandwidth "
                f"{link['bandwidth'] / 1e9:.2f} GB/s; all-reduce "
                f"{link['allreduce_bandwidth'] / 1e9:.2f} GB/s; runner overhead "
                f"{link.get('overhead_s', 0.0) * 1e6:.0f} µs per stage and micro-batch.",
                "",
            ]
            lines += _table("Two devices: distributed runner", two["rows"])
    return "\n".join(lines) + "\n"
