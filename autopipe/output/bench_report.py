"""The text and the picture of a measured step benchmark (``autopipe bench``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from autopipe.output.bench_summary import SplitSummary, speedups
from autopipe.output.timeline import check_picture_path, new_figure, save_figure, time_unit
from autopipe.planning import format_bytes, format_time

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["draw_bench", "render_bench"]

_MEASURED = "#4C72B0"
_PREDICTED = "#9A9A9A"
_IDEAL = "#55A868"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """Columns padded to their widest cell: the first ``left`` to the left, the rest right."""
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _memory(summary: SplitSummary) -> str:
    if all(peak is None for peak in summary.saved_peak):
        return "-"
    return ", ".join("-" if peak is None else format_bytes(peak) for peak in summary.saved_peak)


def render_bench(summaries: Sequence[SplitSummary], header: str = "") -> str:
    """The benchmark's report: one row per split, the speed-ups, what bounds the ideal.

    Args:
        summaries: the splits, in the order to print them.
        header: a first line saying what was run (stages, micro-batches, runner, loss).
    """
    rows = [
        [
            s.label,
            str(s.balance),
            format_time(s.measured),
            f"{100 * s.spread:.1f}%",
            format_time(s.predicted),
            f"{s.over_predicted:.2f}x",
            format_time(s.ideal),
            f"{s.over_ideal:.2f}x",
        ]
        for s in summaries
    ]
    headers = ["split", "balance", "measured", "spread", "predicted", "meas/pred"]
    headers += ["ideal", "meas/ideal"]
    parts = [header] if header else []
    parts.append(_table(headers, rows, left=2))
    parts.append("")
    # The count sees the tensors the layers save for backward; the plan's figure also
    # holds the stage's boundary inputs, so it is the larger where those are kept.
    if any(len(s.saved_peak) < len(s.predicted_activation) for s in summaries):
        # Several stages per rank: one count sees all of a rank's stages at once.
        parts.append(
            "activations at the peak: measured per rank, its stages together (saved for "
            "backward), predicted per stage (saved and boundary inputs):"
        )
    else:
        parts.append(
            "activations at the peak, per stage: measured (saved for backward), predicted "
            "(saved and boundary inputs):"
        )
    memory = [
        [s.label, _memory(s), ", ".join(format_bytes(b) for b in s.predicted_activation)]
        for s in summaries
    ]
    parts.append(_table(["split", "measured", "predicted"], memory, left=3))
    if len(summaries) > 1:
        parts.append("")
        parts.append("speed-up of the row over the column (column's step / row's step):")
        table = speedups(summaries)
        labels = [s.label for s in summaries]
        grid = [[a, *("-" if a == b else f"{table[a][b]:.2f}x" for b in labels)] for a in labels]
        parts.append(_table(["", *labels], grid))
    bound = [s for s in summaries if s.bound_unit is not None]
    if bound:
        parts.append("")
    for s in bound:
        assert s.bound_unit is not None
        name, cost = s.bound_unit
        share = sum(s.stage_times) / len(s.stage_times)
        parts.append(
            f"{s.label}: the ideal is not reachable: unit {name} costs {format_time(cost)} "
            f"per micro-batch, more than a perfect share Σc/K = {format_time(share)}"
        )
    return "\n".join(parts) + "\n"


def draw_bench(summaries: Sequence[SplitSummary], path: str | os.PathLike[str]) -> None:
    """Draws each split's measured step (median, with its interquartile range as an error
    bar), its predicted step and the ideal balanced bound.

    Args:
        summaries: the splits, in the order to draw them.
        path: a ``.png`` or ``.svg`` file; written atomically.

    Raises:
        ValueError: no splits, or the extension is neither ``.png`` nor ``.svg``.
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    fmt = check_picture_path(path, "benchmark picture")
    if not summaries:
        raise ValueError("draw_bench needs at least one split")
    import numpy as np

    largest = max(max(max(s.times), s.predicted, s.ideal) for s in summaries)
    scale, unit = time_unit(largest)
    fig = new_figure(max(6.0, 1.6 * len(summaries) + 2.0), 4.5)
    ax: Axes = fig.add_subplot()
    xs = np.arange(len(summaries))
    medians = [s.measured * scale for s in summaries]
    lows, highs = [], []
    for s in summaries:
        q1, q3 = np.percentile(s.times, [25, 75])
        lows.append(max(0.0, s.measured - q1) * scale)
        highs.append(max(0.0, q3 - s.measured) * scale)
    ax.bar(xs - 0.2, medians, 0.4, color=_MEASURED, label="measured (median, IQR)")
    ax.errorbar(xs - 0.2, medians, yerr=[lows, highs], fmt="none", ecolor="black", capsize=4)
    ax.bar(
        xs + 0.2, [s.predicted * scale for s in summaries], 0.4, color=_PREDICTED, label="predicted"
    )
    for x, s in zip(xs, summaries):
        ax.hlines(
            s.ideal * scale,
            x - 0.45,
            x + 0.45,
            colors=_IDEAL,
            linestyles="dashed",
            label="ideal balanced bound" if x == 0 else "_nolegend_",
        )
    ax.set_xticks(xs, [f"{s.label}\n{s.balance}" for s in summaries])
    ax.set_ylabel(f"step time ({unit})")
    ax.set_title("measured training step per split")
    ax.set_ylim(0, largest * scale * 1.3)  # room for the legend above the bars
    ax.legend(loc="upper right", fontsize="small", ncol=3)
    ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, fmt, "picture")
