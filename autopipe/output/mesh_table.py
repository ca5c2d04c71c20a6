"""The ranked table of a mesh search: each plan's mesh, speed per device and bottleneck.

A mesh search (:func:`autopipe.search` with tensor, context or ZeRO degrees) ranks plans
that each take every device; the rows show per device what a cluster is judged by: tokens
per second, model TFLOP/s (the profile's counted FLOPs, forward and backward, without
re-computation), the model FLOPs utilization against the estimate's dense peak, the peak
memory, and the largest share of the step that is not the layers' own compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopipe.output.plan_summary import checkpoint_label, device_memory
from autopipe.planning import Plan, format_bytes, format_time

__all__: list[str] = []

# What a step loses besides compute, by the plan's figures.
_LABELS = {
    "tensor": "TP comm",
    "context": "CP ring",
    "zero": "ZeRO exchange",
    "expert": "EP all-to-all",
}


def mesh_label(plan: Plan) -> str:
    """The plan's layout, e.g. ``TP=8 SP CP=1 PP=16 v=2 DP=128 ZeRO-1`` (``EP=8`` after
    the context degree with expert parallelism)."""
    m = plan.mesh
    sp = " SP" if m.sequence_parallel else ""
    ranks = plan.num_stages // max(plan.virtual_stages, 1)
    virtual = f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    zero = max(m.zero, 1 if plan.shard_optimizer else 0)
    ep = f" EP={m.expert}" if m.expert > 1 else ""
    return (
        f"TP={m.tensor}{sp} CP={m.context}{ep} PP={ranks}{virtual} DP={plan.data_parallel} "
        f"ZeRO-{zero}"
    )


def losses(plan: Plan) -> dict[str, float]:
    """Seconds per step of what is not compute: the pipeline's bubble, the mesh's exposed
    communication by kind, and the data-parallel exchange after the drain."""
    out = {_LABELS[kind]: seconds for kind, seconds in plan.mesh_parts.items()}
    out["bubble"] = plan.bubble * plan.pipeline_time
    out["DP sync"] = plan.allreduce
    return out


def bottleneck(plan: Plan) -> str:
    """The largest loss and its share of the step, or ``compute`` when none is 5% of it."""
    found = losses(plan)
    name = max(found, key=lambda key: found[key])
    share = found[name] / plan.step_time if plan.step_time else 0.0
    return f"{name} {share:.0%}" if share >= 0.05 else "compute"


def _rate(value: float) -> str:
    """Three significant digits, thousands separated: ``1,234`` or ``0.0123``."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def render_mesh_search(plans: Sequence[Plan]) -> str:
    """The table, then the chosen mesh and why the runner-up lost, in one line each."""
    headers = ["#", "mesh", "M", "checkpoint", "schedule", "step", "tokens/s/GPU"]
    headers += ["TFLOP/s/GPU", "MFU", "memory", "bottleneck", "vs the best"]
    rows = []
    for rank, plan in enumerate(plans, start=1):
        peak = max(device_memory(plan))  # a rank's stages together
        rows.append(
            [
                str(rank),
                mesh_label(plan),
                f"{plan.chunks} x {plan.micro_batch}",
                checkpoint_label(plan).replace(" stages checkpoint", ""),
                plan.schedule,
                format_time(plan.step_time),
                _rate(plan.tokens_per_device) if plan.sequence else "-",
                _rate(plan.flops_per_device / 1e12) if plan.model_flops else "-",
                f"{plan.utilization:.1%}" if plan.peak_flops else "-",
                format_bytes(peak),
                bottleneck(plan),
                "best" if rank == 1 else "; ".join(plan.notes),
            ]
        )
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    right = {0, 2, 5, 6, 7, 8, 9}

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    out = [line(row) for row in [headers, *rows]]
    if plans:
        out.append(f"- chosen mesh: {mesh_label(plans[0])}, bottleneck {bottleneck(plans[0])}")
        if len(plans) > 1 and plans[1].notes:
            note = plans[1].notes[0]
            # A tie is no loss: the note then says what told the two apart.
            verb = "" if note.startswith("ties with") else "loses: "
            out.append(f"- the runner-up ({mesh_label(plans[1])}) {verb}{note}")
        out += [f"- {note}" for note in plans[0].notes]
    return "\n".join(out)
