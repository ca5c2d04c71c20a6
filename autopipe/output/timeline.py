"""Pictures of a plan: its schedule as a Gantt chart, and per-stage time bars.

The events come from :func:`autopipe.planning.schedules.simulation.simulate` (re-exported here with
the other simulation names). matplotlib is optional (the ``plot`` extra) and is imported only
when a picture is drawn.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from autopipe.output.report import schedule_label
from autopipe.output.trace_events import trace, write_trace
from autopipe.planning import (
    KINDS,
    Plan,
    checkpointed,
    format_time,
    makespan,
    simulate,
    stage_times,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "check_picture_path",
    "checkpointed",
    "draw_stage_bars",
    "draw_timeline",
    "require_matplotlib",
    "trace",
    "write_trace",
]

_COLORS = {
    "forward": "#4C72B0",
    "recompute": "#8172B3",
    "backward": "#DD8452",
    "weight": "#55A868",
    "transfer": "#9A9A9A",
}
_PICTURE_FORMATS = ("png", "svg")


# ----------------------------------------------------------------------------------------
# Pictures. matplotlib is optional (the `plot` extra) and is imported only here.


def require_matplotlib() -> None:
    """Checks that matplotlib can be imported.

    Raises:
        ImportError: with a one-line message saying how to install it.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError(
            "drawing pictures needs matplotlib: pip install 'autopipe[plot]' "
            "(or pip install matplotlib)"
        ) from None


def check_picture_path(path: str | os.PathLike[str], what: str = "picture") -> str:
    """The picture format of ``path``, from its extension.

    Args:
        path: where the picture will be written.
        what: what is drawn, for the error message.

    Returns:
        ``png`` or ``svg``.

    Raises:
        ValueError: the extension is neither ``.png`` nor ``.svg``.
    """
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in _PICTURE_FORMATS:
        raise ValueError(
            f"cannot draw the {what} to {os.fspath(path)}: use a .png or .svg file name"
        )
    return suffix


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches with a constrained layout."""
    require_matplotlib()
    # Figure without pyplot: no global state, no GUI backend, safe in threads and servers.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save_figure(fig: Figure, path: str | os.PathLike[str], fmt: str, what: str) -> None:
    """Writes the figure atomically: a failed save leaves no half-written picture."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    try:
        fig.savefig(tmp, format=fmt, dpi=150)
        os.replace(tmp, target)
    except OSError as exc:
        raise OSError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)


def time_unit(seconds: float) -> tuple[float, str]:
    """A scale and unit name that keep the axis numbers readable."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


_LABEL_FONT = 7.0  # points
_CHAR_WIDTH = 0.62  # average digit width, in units of the font size


def _fits(width_points: float, text: str) -> bool:
    return width_points >= len(text) * _CHAR_WIDTH * _LABEL_FONT + 3.0


# Local stages of one device, told apart by hatching (stage k, k+K, k+2K, ...).
_HATCHES = ("", "///", "...", "xxx", "\\\\\\", "+++")


def draw_timeline(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Draws the simulated step of ``plan`` as a Gantt chart.

    One row per device (device 0 on top; with virtual stages its stages ``k, k+K, …``
    told apart by hatching); forwards, recomputes, backwards and sends in distinct
    colours, idle time as gaps; micro-batch numbers inside the bars wide enough to hold
    them. The title gives the balance, M, schedule, predicted step time and bubble.

    Args:
        plan: the plan to draw (see :func:`simulate`).
        path: a ``.png`` or ``.svg`` file; written atomically.

    Raises:
        ValueError: the extension is neither ``.png`` nor ``.svg``.
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    fmt = check_picture_path(path, "timeline")
    events = simulate(plan)
    span = makespan(events)
    scale, unit = time_unit(span)
    virtual = max(plan.virtual_stages, 1)
    rows = plan.num_stages // virtual
    width = 12.0
    fig = new_figure(width, 1.7 + 0.55 * rows * (1.0 if virtual == 1 else 1.3))
    ax = fig.add_subplot()

    present = [kind for kind in KINDS if any(e.kind == kind for e in events)]
    for kind in present:
        for k in range(plan.num_stages):
            bars = [
                (e.start * scale, e.duration * scale)
                for e in events
                if e.kind == kind and e.stage == k
            ]
            if bars:
                # White edges keep back-to-back bars of one kind apart.
                ax.broken_barh(
                    bars,
                    (k % rows - 0.38, 0.76),
                    facecolors=_COLORS[kind],
                    edgecolors="white",
                    linewidth=0.6,
                    hatch=_HATCHES[(k // rows) % len(_HATCHES)] or None,
                )

    busy = [0.0] * rows
    for e in events:
        busy[e.stage % rows] += e.duration
    labels = []
    for r in range(rows):
        name = f"stage {r}" if virtual == 1 else f"device {r}\nstages {r}"
        if virtual > 1:
            name += "".join(f", {r + j * rows}" for j in range(1, virtual))
        labels.append(f"{name}\n{busy[r] / span:.0%} busy" if span > 0 else name)
    ax.set_yticks(range(rows), labels)
    ax.set_ylim(rows - 0.5, -0.5)  # stage 0 on top, like a pipeline diagram
    ax.set_xlim(0, span * scale if span > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_COLORS[kind], label=kind) for kind in present]
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", label="idle"))
    for j in range(1, min(virtual, len(_HATCHES))):
        label = f"local stage {j} (stages {j * rows}-{(j + 1) * rows - 1})"
        handles.append(
            Patch(facecolor="white", edgecolor="#555555", hatch=_HATCHES[j], label=label)
        )
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)

    simulated = ""
    if plan.step_time > 0 and abs(span - plan.step_time) > 1e-3 * plan.step_time:
        simulated = f" (simulated {format_time(span)})"
    layout = f"{rows} stages" if virtual == 1 else f"{plan.num_stages} stages on {rows} devices"
    fig.suptitle(
        f"{plan.strategy} split {list(plan.balance)}: {layout}, M = {plan.chunks} "
        f"micro-batches of {plan.micro_batch}, {schedule_label(plan)}, "
        f"checkpoint {plan.checkpoint}\n"
        f"predicted step {format_time(plan.step_time)}{simulated}, "
        f"bubble {plan.bubble:.1%}, bottleneck stage {plan.bottleneck_stage} "
        f"({format_time(plan.bottleneck)} per micro-batch)",
        fontsize=10,
    )

    # Micro-batch numbers go in last, once the layout is final: a bar holds its number
    # only if it is wide enough on the page.
    fig.draw_without_rendering()
    axes_points = ax.get_window_extent().width * 72.0 / fig.dpi
    points_per_second = axes_points / span if span > 0 else 0.0
    for e in events:
        text = str(e.micro_batch)
        if e.kind != "transfer" and _fits(e.duration * points_per_second, text):
            ax.text(
                (e.start + e.duration / 2) * scale,
                e.stage % rows,
                text,
                ha="center",
                va="center",
                fontsize=_LABEL_FONT,
                color="white",
            )
    save_figure(fig, path, fmt, "timeline")


def _stage_bar_parts(plan: Plan) -> dict[str, list[float]]:
    parts: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for t in stage_times(plan):
        parts["forward"].append(t.forward)
        parts["recompute"].append(t.recompute)
        parts["backward"].append(t.backward)
        parts["transfer"].append(t.transfer)
    return parts


def draw_stage_bars(plans: Mapping[str, Plan], path: str | os.PathLike[str]) -> None:
    """Draws each plan's stage times side by side: how balanced each split is.

    One group per plan, one bar per stage (stage 0 on the left), stacked into forward,
    recompute, backward and send per micro-batch. The bottleneck stage has a black outline
    and its time on top; a dashed line marks the group's mean, the height of a perfectly
    balanced split.

    Args:
        plans: plans of the same model by label, e.g. ``{"optimal": ..., "uniform": ...}``.
        path: a ``.png`` or ``.svg`` file; written atomically.

    Raises:
        ValueError: no plans, or the extension is neither ``.png`` nor ``.svg``.
        ImportError: matplotlib is not installed.
        OSError: the file cannot be written.
    """
    fmt = check_picture_path(path, "stage bars")
    if not plans:
        raise ValueError("draw_stage_bars needs at least one plan")
    largest = max(p.bottleneck for p in plans.values())
    scale, unit = time_unit(largest)
    widest = max(p.num_stages for p in plans.values())
    fig = new_figure(max(7.0, 3.0 + 0.5 * widest * len(plans)), 4.8)
    ax: Axes = fig.add_subplot()
    bar = 0.8 / widest
    seen: set[str] = set()
    ticks, names = [], []
    for g, (label, plan) in enumerate(plans.items()):
        parts = _stage_bar_parts(plan)
        k_count = plan.num_stages
        xs = [g - 0.4 + bar * (k + 0.5) + bar * (widest - k_count) / 2 for k in range(k_count)]
        bottom = [0.0] * k_count
        for kind in KINDS:
            heights = [v * scale for v in parts[kind]]
            if not any(heights):
                continue
            ax.bar(
                xs,
                heights,
                bar * 0.9,
                bottom=bottom,
                color=_COLORS[kind],
                label="_nolegend_" if kind in seen else kind,
            )
            seen.add(kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        worst = plan.bottleneck_stage
        ax.bar(
            xs[worst],
            plan.stages[worst].time * scale,
            bar * 0.9,
            fill=False,
            edgecolor="black",
            linewidth=1.8,
            label="_nolegend_" if "bottleneck" in seen else "bottleneck",
        )
        seen.add("bottleneck")
        ax.annotate(
            format_time(plan.bottleneck),
            (xs[worst], plan.stages[worst].time * scale),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
        mean = sum(s.time for s in plan.stages) / k_count * scale
        ax.hlines(
            mean,
            xs[0] - bar / 2,
            xs[-1] + bar / 2,
            colors="black",
            linestyles="dashed",
            linewidth=0.9,
            label="_nolegend_" if "mean" in seen else "mean (perfect balance)",
        )
        seen.add("mean")
        ticks.append(g)
        names.append(f"{label}\n{list(plan.balance)}\nstep {format_time(plan.step_time)}")
    ax.set_xticks(ticks, names, fontsize=8)
    ax.set_xlim(-0.5, len(plans) - 0.5)
    ax.set_ylim(0, largest * scale * 1.12)
    ax.set_ylabel(f"time per micro-batch ({unit})")
    fig.suptitle(
        "Stage time per micro-batch by split (bars: stage 0, 1, … left to right)", fontsize=10
    )
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    save_figure(fig, path, fmt, "stage bars")
