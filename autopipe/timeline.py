"""A plan's pipeline schedule as timed events, and pictures of it (Gantt chart, stage bars).

:func:`simulate` replays one training step of a :class:`~autopipe.plans.Plan` as a small
discrete-event simulation. Each stage runs its micro-batches in the schedule's order
(GPipe fill–drain or 1F1B); an operation starts when its stage is free and its input has
arrived. Per micro-batch, stage ``k`` spends:

- ``f_k`` on a forward, then ``t_k`` sending its output to stage ``k+1`` (the stage is busy
  while it sends, as the cost model charges the send to the stage's time);
- ``f_k`` on a recompute right before the backward of every checkpointed micro-batch
  (``always``: all, ``except_last``: all but the last, ``never``: none);
- ``b_k`` on a backward, whose input gradient arrives at stage ``k-1`` when it ends (the
  cost model charges one send per micro-batch, so the gradient's trip back is free here).

``f_k`` and ``b_k`` split the plan's ``compute`` in the profile's forward:backward ratio
(1:2 when the plan carries no profile), so that ``f_k·(1 + r) + b_k + t_k`` is exactly
the plan's stage time ``c_k``.

How the simulated makespan relates to the plan's ``step_time = Σc + (M−1)·max c``
(GPipe's formula, which the planner uses for both schedules):

- GPipe, ``checkpoint`` ``always`` or ``never``: equal when each stage's forward (with its
  send) and backward (with its recompute) are in the same proportion on every stage, e.g.
  free transfers and layers whose backward is a fixed multiple of their forward; otherwise
  larger, because forwards and backwards run as two separate phases: the simulation pays
  ``max f + max b`` where the formula pays ``max (f + b)``.
- GPipe, ``except_last``: for such proportional stages, within ``(M+K−1)/M · max f``
  (about one forward) of the formula. The formula spreads the recompute evenly over the M
  micro-batches; in the schedule the one micro-batch that is not recomputed goes backward
  first. With balanced stages the simulation is longer by exactly ``(K−1)·f/M``.
- 1F1B: the same as GPipe when stages are balanced (``always`` or ``never``); with
  unbalanced stages often shorter, since a stage's backwards need not wait for every
  forward of the step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autopipe.plans import Plan
from autopipe.units import format_time

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "COLORS",
    "KINDS",
    "PICTURE_FORMATS",
    "Event",
    "StageTimes",
    "check_picture_path",
    "checkpointed",
    "draw_stage_bars",
    "draw_timeline",
    "makespan",
    "require_matplotlib",
    "simulate",
    "stage_times",
]

KINDS = ("forward", "recompute", "backward", "transfer")
COLORS = {
    "forward": "#4C72B0",
    "recompute": "#8172B3",
    "backward": "#DD8452",
    "transfer": "#9A9A9A",
}
PICTURE_FORMATS = ("png", "svg")
# Backward takes about twice the forward (gradients of inputs and of weights).
_DEFAULT_BACKWARD_RATIO = 2.0


@dataclass(frozen=True)
class Event:
    """One operation of the simulated step.

    Attributes:
        stage: the stage that runs it.
        micro_batch: the micro-batch it works on, from 0.
        kind: ``forward``, ``recompute``, ``backward`` or ``transfer`` (the stage sending
            its forward output to the next stage).
        start: seconds from the start of the step.
        end: seconds from the start of the step.
    """

    stage: int
    micro_batch: int
    kind: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class StageTimes:
    """Seconds one stage spends per micro-batch on each kind of operation.

    Attributes:
        forward: one forward (also the length of one recompute).
        backward: one backward.
        transfer: sending one forward output to the next stage.
        recompute_fraction: share of micro-batches recomputed, so that
            ``forward·(1 + recompute_fraction) + backward + transfer`` is the plan's
            stage time.
    """

    forward: float
    backward: float
    transfer: float
    recompute_fraction: float

    @property
    def recompute(self) -> float:
        """Recompute seconds per micro-batch on average."""
        return self.forward * self.recompute_fraction

    @property
    def total(self) -> float:
        """The stage's cost per micro-batch, as in the plan."""
        return self.forward + self.recompute + self.backward + self.transfer


def checkpointed(plan: Plan, micro_batch: int, stage: int = 0) -> bool:
    """Whether ``micro_batch`` recomputes its forward in backward on ``stage``.

    A plan with ``checkpoint="auto"`` chooses the mode per stage.
    """
    modes = plan.stage_checkpoints if plan.stages else [plan.checkpoint]
    mode = modes[min(stage, len(modes) - 1)]
    if mode == "always":
        return True
    if mode == "except_last":
        return micro_batch < plan.chunks - 1
    return False


def _recompute_fraction(plan: Plan, stage: int) -> float:
    m = plan.chunks
    return sum(checkpointed(plan, i, stage) for i in range(m)) / m


def _layer_times(plan: Plan) -> tuple[list[float], list[float]] | None:
    """Per-layer forward and backward seconds at the plan's micro-batch, if it has a profile."""
    if not plan.profile:
        return None
    # Imported here: the profile module is light, but plans loaded without one need none.
    from profiler.profile import Profile

    try:
        profile = Profile.from_dict(plan.profile)
    except (ValueError, KeyError, TypeError):
        return None
    n = len(profile)
    if n < max(stage.stop for stage in plan.stages):
        return None
    forward = [profile.predict(i, "forward", plan.micro_batch) for i in range(n)]
    backward = [profile.predict(i, "backward", plan.micro_batch) for i in range(n)]
    return forward, backward


def stage_times(plan: Plan) -> list[StageTimes]:
    """Splits each stage's predicted time into forward, recompute, backward and transfer.

    The forward:backward ratio comes from the plan's profile (device speed divides both,
    so it cancels); the parts are then scaled so that they add up to the plan's
    ``compute`` exactly. Without a usable profile, backward is taken as twice the forward.

    Args:
        plan: the plan.

    Returns:
        One entry per stage.
    """
    layers = _layer_times(plan)
    out = []
    for stage in plan.stages:
        r = _recompute_fraction(plan, stage.index)
        f, b = 1.0, _DEFAULT_BACKWARD_RATIO
        if layers is not None:
            # A fitted line can dip below zero for a tiny layer; a stage's sum rarely does.
            lf = max(sum(layers[0][stage.start : stage.stop]), 0.0)
            lb = max(sum(layers[1][stage.start : stage.stop]), 0.0)
            if lf + lb > 0:
                f, b = lf, lb
        scale = stage.compute / (f * (1.0 + r) + b)
        out.append(StageTimes(f * scale, b * scale, stage.transfer, r))
    return out


def _orders(plan: Plan) -> list[list[tuple[str, int]]]:
    """Each stage's operations in the order it runs them: ``("F", i)`` or ``("B", i)``."""
    k_count, m = plan.num_stages, plan.chunks
    orders = []
    for k in range(k_count):
        if plan.schedule == "1f1b":
            # Warm-up fills the pipeline below this stage; then one forward, one backward.
            warmup = min(k_count - k - 1, m)
            order = [("F", i) for i in range(warmup)]
            for j in range(m - warmup):
                order += [("F", warmup + j), ("B", j)]
            order += [("B", i) for i in range(m - warmup, m)]
        else:
            # GPipe: all forwards, then backwards in reverse (autograd's order).
            order = [("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))]
        orders.append(order)
    return orders


def simulate(plan: Plan) -> list[Event]:
    """Simulates one training step of ``plan`` under its schedule.

    A forward of micro-batch ``i`` on stage ``k`` starts when stage ``k`` is free and
    stage ``k−1`` has finished (and sent) micro-batch ``i``; a backward starts when the
    stage is free and stage ``k+1`` has finished the backward of ``i`` (on the last stage:
    its own forward of ``i``). A checkpointed micro-batch recomputes its forward right
    before its backward. See the module docstring for how the makespan compares with the
    plan's ``step_time``.

    Args:
        plan: the plan; its ``schedule`` (``gpipe`` or ``1f1b``), ``chunks`` and
            ``checkpoint`` set the order of operations, its stage times their lengths.

    Returns:
        Every event of the step, ordered by start time then stage. Zero-length transfers
        are left out.

    Raises:
        ValueError: the plan's schedule is unknown.
    """
    if plan.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {plan.schedule!r}: choose gpipe or 1f1b")
    times = stage_times(plan)
    orders = _orders(plan)
    k_count = plan.num_stages
    # When each stage's forward output / backward gradient of micro-batch i is available.
    sent: dict[tuple[int, int], float] = {}
    grads: dict[tuple[int, int], float] = {}
    free = [0.0] * k_count
    position = [0] * k_count
    events: list[Event] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for k in range(k_count):
            t = times[k]
            while position[k] < len(orders[k]):
                op, i = orders[k][position[k]]
                if op == "F":
                    ready = 0.0 if k == 0 else sent.get((k - 1, i))
                else:
                    ready = sent.get((k, i)) if k == k_count - 1 else grads.get((k + 1, i))
                if ready is None:  # waits on another stage; come back on the next sweep
                    break
                start = max(free[k], ready)
                if op == "F":
                    end = start + t.forward
                    events.append(Event(k, i, "forward", start, end))
                    if k < k_count - 1 and t.transfer > 0:
                        events.append(Event(k, i, "transfer", end, end + t.transfer))
                        end += t.transfer
                    sent[(k, i)] = end
                else:
                    if checkpointed(plan, i, k):
                        events.append(Event(k, i, "recompute", start, start + t.forward))
                        start += t.forward
                    end = start + t.backward
                    events.append(Event(k, i, "backward", start, end))
                    grads[(k, i)] = end
                free[k] = end
                position[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the two schedules above; guards edits
            raise RuntimeError("the pipeline schedule deadlocks")
    events.sort(key=lambda e: (e.start, e.stage, KINDS.index(e.kind)))
    return events


def makespan(events: Sequence[Event]) -> float:
    """Seconds from the first event's start to the last event's end (0 for none)."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


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
    if suffix not in PICTURE_FORMATS:
        raise ValueError(
            f"cannot draw the {what} to {os.fspath(path)}: use a .png or .svg file name"
        )
    return suffix


def _new_figure(width: float, height: float) -> Figure:
    require_matplotlib()
    # Figure without pyplot: no global state, no GUI backend, safe in threads and servers.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: Figure, path: str | os.PathLike[str], fmt: str, what: str) -> None:
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


def _time_unit(seconds: float) -> tuple[float, str]:
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


def draw_timeline(plan: Plan, path: str | os.PathLike[str]) -> None:
    """Draws the simulated step of ``plan`` as a Gantt chart.

    One row per stage (stage 0 on top); forwards, recomputes, backwards and sends in
    distinct colours, idle time as gaps; micro-batch numbers inside the bars wide enough to
    hold them. The title gives the balance, M, schedule, predicted step time and bubble.

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
    scale, unit = _time_unit(span)
    k_count = plan.num_stages
    width = 12.0
    fig = _new_figure(width, 1.7 + 0.55 * k_count)
    ax = fig.add_subplot()

    present = [kind for kind in KINDS if any(e.kind == kind for e in events)]
    for kind in present:
        for k in range(k_count):
            row = [
                (e.start * scale, e.duration * scale)
                for e in events
                if e.kind == kind and e.stage == k
            ]
            if row:
                # White edges keep back-to-back bars of one kind apart.
                ax.broken_barh(
                    row,
                    (k - 0.38, 0.76),
                    facecolors=COLORS[kind],
                    edgecolors="white",
                    linewidth=0.6,
                )

    busy = [0.0] * k_count
    for e in events:
        busy[e.stage] += e.duration
    labels = [
        f"stage {k}\n{busy[k] / span:.0%} busy" if span > 0 else f"stage {k}"
        for k in range(k_count)
    ]
    ax.set_yticks(range(k_count), labels)
    ax.set_ylim(k_count - 0.5, -0.5)  # stage 0 on top, like a pipeline diagram
    ax.set_xlim(0, span * scale if span > 0 else 1.0)
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLORS[kind], label=kind) for kind in present]
    handles.append(Patch(facecolor="white", edgecolor="#bbbbbb", label="idle"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)

    simulated = ""
    if plan.step_time > 0 and abs(span - plan.step_time) > 1e-3 * plan.step_time:
        simulated = f" (simulated {format_time(span)})"
    fig.suptitle(
        f"{plan.strategy} split {list(plan.balance)}: {k_count} stages, M = {plan.chunks} "
        f"micro-batches of {plan.micro_batch}, {plan.schedule}, checkpoint {plan.checkpoint}\n"
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
                e.stage,
                text,
                ha="center",
                va="center",
                fontsize=_LABEL_FONT,
                color="white",
            )
    _save(fig, path, fmt, "timeline")


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
    scale, unit = _time_unit(largest)
    widest = max(p.num_stages for p in plans.values())
    fig = _new_figure(max(7.0, 3.0 + 0.5 * widest * len(plans)), 4.8)
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
                color=COLORS[kind],
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
    _save(fig, path, fmt, "stage bars")
