"""Renders a :class:`Plan` as a plain-text report: a stage table and a summary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from autopipe.output.mesh_table import render_mesh_search
from autopipe.output.plan_summary import checkpoint_label, device_memory
from autopipe.planning import (
    Mesh,
    Plan,
    StagePlan,
    TiedPlan,
    format_bytes,
    format_time,
)

__all__ = ["precision_label", "render_plan", "render_search", "shared_line"]

_BAR_WIDTH = 20
# Said of a float8 estimate whose layers counted their GEMM inputs: the plan's memory holds
# them at one byte per element (autopipe.planning.model.layer_costs).
_FP8_NOTE = "float8: activations of FP8 GEMMs saved in 1 byte"
# Step times closer than this (relative) tie: the cost model is not that exact.
_TIE_TOLERANCE = 0.005


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def bar(fraction: float, width: int = _BAR_WIDTH) -> str:
    """A text bar of ``width`` characters, ``#`` filled in proportion to ``fraction``.

    Args:
        fraction: the filled share, clipped to ``[0, 1]``.
        width: characters in a full bar.
    """
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "#" * filled + "." * (width - filled)


def _labels(plan: Plan) -> list[str]:
    """A label per layer: its name, or its class name when the name is just its index."""
    layers: list[dict[str, Any]] = list(plan.profile.get("layers", []))
    names = [name for stage in plan.stages for name in stage.layers]
    positional = all(name == str(i) for i, name in enumerate(names))
    if positional and len(layers) == len(names):
        return [str(layer.get("kind", name)) for layer, name in zip(layers, names)]
    return names


def _span(stage: StagePlan) -> str:
    last = stage.stop - 1
    return str(stage.start) if last <= stage.start else f"{stage.start}-{last}"


def layer_range(stage: StagePlan, labels: Sequence[str] | None = None, width: int = 0) -> str:
    """A stage's layers as ``0-5  (embed..block4)``, or ``3  (head)`` for one layer.

    Args:
        stage: the stage.
        labels: a label for every layer of the model; default: the stage's layer names.
        width: pads the index range to this width so that the names line up.
    """
    span = _span(stage)
    names = list(stage.layers if labels is None else labels[stage.start : stage.stop])
    if not names:
        return span
    inner = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
    return f"{span.ljust(width)}  ({inner})"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join(line(row) for row in [headers, *rows])


def _device_list(names: set[str]) -> str:
    """The stages' devices in index order, a run of four or more as ``h100:0..h100:31``."""

    def key(name: str) -> tuple[str, int, str]:
        prefix, _, index = name.rpartition(":")
        return (prefix, int(index), "") if index.isdigit() and prefix else (name, -1, name)

    ordered = sorted(names, key=key)
    parts: list[str] = []
    run: list[str] = []

    def close() -> None:
        if len(run) >= 4:
            parts.append(f"{run[0]}..{run[-1]}")
        else:
            parts.extend(run)
        run.clear()

    for name in ordered:
        if run:
            (prefix, index, _), (last_prefix, last, _) = key(name), key(run[-1])
            if prefix != last_prefix or index != last + 1 or index < 0:
                close()
        run.append(name)
    close()
    return ", ".join(parts)


def render_header(plan: Plan) -> str:
    """Two lines on what was planned: layers, stages, batch split and settings."""
    profile = plan.profile
    layers = sum(plan.balance)
    devices = {stage.device for stage in plan.stages}
    where = _device_list(devices)
    device_name = profile.get("device_name")
    if device_name and device_name not in devices:
        where += f" ({device_name})"
    batch = (plan.batch_size or profile.get("batch_size")) if profile else None
    micro = f"{_count(plan.chunks, 'micro-batch', 'micro-batches')} of {plan.micro_batch}"
    if plan.data_parallel > 1:
        micro += " per replica"
    split = f"batch {batch} as {micro}" if batch else micro
    stages = f"{_count(plan.num_stages, 'stage', 'stages')} [{where}]"
    v = plan.virtual_stages
    if v > 1:
        ranks = plan.num_stages // v
        stages += f" on {_count(ranks, 'device', 'devices')}, {v} per device (interleaved)"
    if plan.data_parallel > 1:
        stages += f" x {plan.data_parallel} data-parallel replicas"
    first = f"{layers} layers on {stages}, {split}"
    second = (
        f"strategy {plan.strategy}, schedule {plan.schedule}, "
        f"checkpoint {checkpoint_label(plan)}, optimizer {plan.optimizer}"
    )
    if plan.shard_optimizer:
        second += f" (optimizer state sharded over {plan.data_parallel} replicas, ZeRO-1)"
    precision = precision_label(profile)
    if precision:
        second += f", {precision}"
    estimate = estimate_label(profile)
    return f"{first}\n{second}" + (f"\n{estimate}" if estimate else "")


def estimate_label(profile: Mapping[str, Any]) -> str:
    """For times estimated by :func:`autopipe.planning.hardware.estimates.estimate_profile`, what
    they were estimated for; empty for measured times."""
    meta = profile.get("meta")
    found = meta.get("estimate") if isinstance(meta, Mapping) else None
    if not isinstance(found, Mapping):
        return ""
    target = found.get("target", "?")
    name = found.get("name")
    where = f"{name} ({target})" if name and name != target else str(target)
    how = "efficiencies fitted to measurements" if found.get("fitted") else "default efficiencies"
    label = f"times estimated for {where} from counted FLOPs and bytes, not measured ({how})"
    layers = profile.get("layers")
    counted = isinstance(layers, list) and any(
        isinstance(layer, Mapping) and layer.get("gemm_saved") for layer in layers
    )
    if found.get("dtype") == "float8" and counted:
        label += f"; {_FP8_NOTE}"
    return label


def precision_label(profile: Mapping[str, Any]) -> str:
    """How a profile's layers computed, e.g. ``autocast bfloat16``; empty for float32."""
    parts = []
    dtype = profile.get("dtype")
    if dtype and dtype != "float32":
        parts.append(f"dtype {dtype}")
    if profile.get("autocast"):
        parts.append(f"autocast {profile['autocast']}")
    return ", ".join(parts)


def _stage_mode(stage: StagePlan, plan: Plan) -> str:
    """A stage's checkpoint mode; re-computed units by their count and first names, e.g.
    ``units 2 of 5 (h.0, h.1)``."""
    mode = stage.checkpoint or plan.checkpoint
    if mode != "units":
        return mode
    names = [stage.layers[u - stage.start] for u in stage.recompute_units]
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return f"units {len(names)} of {stage.size} ({shown})"


def render_stages(plan: Plan) -> str:
    """The stage table: index, device, layers, time per micro-batch, memory, share.

    The share is the stage's time as a percentage of the bottleneck's, with a bar. A
    ``send`` column appears when some stage pays for transfers, memory shows the device
    capacity when there is one, and ``auto`` plans show each stage's checkpoint mode.
    """
    labels = _labels(plan)
    span_width = max(len(_span(stage)) for stage in plan.stages)
    sends = any(stage.transfer > 0 for stage in plan.stages)
    headers = ["stage", "device", "layers", "time/micro-batch"]
    if sends:
        headers.append("of which send")
    headers += ["memory", "share of bottleneck"]
    modes = plan.checkpoint == "auto"
    if modes:
        headers.append("checkpoint")
    rows = []
    for stage in plan.stages:
        row = [
            str(stage.index),
            stage.device,
            layer_range(stage, labels, span_width),
            format_time(stage.time),
        ]
        if sends:
            row.append(format_time(stage.transfer))
        memory = format_bytes(stage.memory)
        if stage.capacity is not None:
            used = stage.memory / stage.capacity if stage.capacity else float("inf")
            memory += f" / {format_bytes(stage.capacity)} ({used:.0%})"
        row.append(memory)
        share = stage.time / plan.bottleneck if plan.bottleneck > 0 else 0.0
        row.append(f"{share:6.1%}  {bar(share)}")
        if modes:
            row.append(_stage_mode(stage, plan))
        rows.append(row)
    right = {0, 3, 4} if sends else {0, 3}
    return _table(headers, rows, right)


def render_summary(plan: Plan) -> str:
    """The balance, bottleneck, predicted step time, bubble and pipeline efficiency."""
    stage = plan.stages[plan.bottleneck_stage]
    lines = [
        ("balance", str(list(plan.balance))),
        (
            "bottleneck",
            f"stage {stage.index}, {format_time(plan.bottleneck)} per micro-batch",
        ),
        (
            "step time",
            f"{format_time(plan.step_time)} per mini-batch "
            f"({_count(plan.chunks, 'micro-batch', 'micro-batches')})",
        ),
        ("bubble", f"{plan.bubble:.1%} of the step idle"),
        ("efficiency", f"{plan.efficiency:.1%} of the pipeline busy"),
    ]
    if plan.allreduce > 0:
        lines.insert(3, ("all-reduce", f"{format_time(plan.allreduce)} per step, in the step time"))
    if plan.throughput > 0 and plan.data_parallel > 1:
        lines.append(("throughput", format_rate(plan.throughput)))
    if plan.virtual_stages > 1:
        memory = ", ".join(format_bytes(m) for m in device_memory(plan))
        lines.append(("memory", f"{memory} per device (its stages together)"))
    lines += [("tied", tied_line(item)) for item in plan.tied]
    lines += [("shared", shared_line(plan, group)) for group in plan.shared]
    width = max(len(key) for key, _ in lines)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in lines)


def shared_line(plan: Plan, group: Sequence[int]) -> str:
    """Stages that take turns on one device, e.g. ``stages 0, 1 share cpu: they run one
    after another, so the step is at least 8 × their summed time``."""
    device = plan.stages[group[0]].device
    which = ", ".join(str(k) for k in group)
    line = (
        f"stages {which} share {device}: they run one after another, so the step is at "
        f"least {plan.chunks} x their summed time"
    )
    if len(group) == plan.num_stages and plan.strategy == "optimal":
        line += "; every split takes as long, the least memory per stage chose this one"
    return line


def tied_line(item: TiedPlan) -> str:
    """Where a tied tensor's copies are, e.g. ``lm_head.weight = transformer.wte.weight on
    stages 0, 3 (1.5 MiB each; gradients summed, 0.4 ms a step)``."""
    names = " = ".join(item.names)
    size = format_bytes(item.bytes)
    if len(item.stages) == 1:
        return f"{names} on stage {item.stages[0]} (one copy, {size})"
    where = f"{names} on stages {', '.join(str(k) for k in item.stages)} ({size} each"
    if item.buffer:
        return f"{where}; a buffer, copied)"
    cost = f", {format_time(item.time)} a step" if item.time > 0 else ""
    return f"{where}; gradients summed{cost})"


def render_comparison(plan: Plan, baseline: Plan | str, name: str = "uniform") -> str:
    """One line comparing ``plan`` with another split of the same model.

    Args:
        plan: the chosen plan.
        baseline: the plan to compare with, or why there is none (e.g. it does not fit).
        name: the baseline's strategy, used when ``baseline`` is a message.

    Returns:
        e.g. ``uniform [4, 4]: step 12.3 ms, bottleneck 1.8 ms — optimal is 1.42x faster``,
        or ``... — as fast as optimal`` when the step times are within
        :data:`_TIE_TOLERANCE` of each other.
    """
    if isinstance(baseline, str):
        return f"vs {name}: {baseline}"
    head = f"{baseline.strategy} {list(baseline.balance)}"
    if list(baseline.balance) == list(plan.balance):
        return f"{head}: the same split as {plan.strategy}"
    figures = (
        f"{head}: step {format_time(baseline.step_time)}, "
        f"bottleneck {format_time(baseline.bottleneck)}"
    )
    if plan.step_time <= 0 or baseline.step_time <= 0:
        return figures
    ratio = baseline.step_time / plan.step_time
    if abs(ratio - 1) <= _TIE_TOLERANCE:  # "1.00x faster" would read as a win
        return f"{figures} — as fast as {plan.strategy}"
    verdict = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
    return f"{figures} — {plan.strategy} is {verdict}"


def render_plan(plan: Plan, baseline: Plan | str | None = None, name: str = "uniform") -> str:
    """The full report: header, stage table, summary and, given a baseline, a comparison.

    Args:
        plan: the plan to show.
        baseline: another plan of the same model to compare with, or a message saying
            why there is none; ``None`` leaves the comparison out.
        name: the baseline's strategy, used when ``baseline`` is a message.
    """
    parts = [render_header(plan), render_stages(plan), render_summary(plan)]
    if baseline is not None:
        parts.append(render_comparison(plan, baseline, name))
    return "\n\n".join(parts) + "\n"


def format_rate(samples_per_second: float) -> str:
    """Samples per second with three significant digits, e.g. ``1.23k samples/s``."""
    value, unit = samples_per_second, ""
    for prefix in ("k", "M", "G"):
        # Compared once rounded: 999.6 is written 1k, not 1e+03.
        if float(f"{value:.3g}") < 1000:
            break
        value, unit = value / 1000, prefix
    text = f"{value:.0f}" if value >= 999.5 else f"{value:.3g}"  # no exponent past 1000G
    return f"{text}{unit} samples/s"


def schedule_label(plan: Plan) -> str:
    """The schedule as torch names it, with the stages per device when there are several."""
    if plan.schedule in ("zbv", "dualpipev"):
        return f"{'zero bubble V' if plan.schedule == 'zbv' else 'DualPipeV'}, 2 stages per device"
    if plan.schedule == "zb":
        per = f", {plan.virtual_stages} stages per device" if plan.virtual_stages > 1 else ""
        return f"zero bubble{per}"
    if plan.virtual_stages <= 1:
        return plan.schedule
    name = "interleaved 1f1b" if plan.schedule == "1f1b" else "looped bfs"
    return f"{name}, {plan.virtual_stages} stages per device"


def render_search(plans: Sequence[Plan]) -> str:
    """The ranked table of a :func:`autopipe.search`, then the best plan's notes.

    One row per configuration: K devices per pipeline, D replicas, M micro-batches (of b
    samples), checkpointing, schedule (with virtual stages: torch's interleaved schedule and
    the stages per device), predicted step time, throughput, peak memory per device and
    why it is slower than the best; the best plan's tied parameters last.
    """
    if any(plan.model_flops or plan.sequence or plan.mesh != Mesh() for plan in plans):
        return render_mesh_search(plans)  # a mesh search: per device, every device taken
    headers = ["#", "K", "D", "M", "checkpoint", "schedule", "step", "throughput", "memory"]
    headers.append("vs the best")
    rows = []
    for rank, plan in enumerate(plans, start=1):
        peak = max(device_memory(plan))
        rows.append(
            [
                str(rank),
                str(plan.num_stages // plan.virtual_stages),
                str(plan.data_parallel),
                f"{plan.chunks} x {plan.micro_batch}",
                checkpoint_label(plan).replace(" stages checkpoint", ""),
                schedule_label(plan),
                format_time(plan.step_time),
                format_rate(plan.throughput),
                format_bytes(peak),
                "best" if rank == 1 else "; ".join(plan.notes),
            ]
        )
    table = _table(headers, rows, {0, 1, 2, 3, 6, 7, 8})
    notes = [f"- {note}" for note in plans[0].notes] if plans else []
    tied = [f"- tied {tied_line(item)}" for item in plans[0].tied] if plans else []
    return "\n".join([table, *notes, *tied])
