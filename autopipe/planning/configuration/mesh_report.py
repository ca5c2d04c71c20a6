"""What a mesh search's plans report beyond the pipeline: model FLOPs, the mesh's exposed
communication per step, and why a runner-up's mesh loses, in one line.

Model FLOPs are the profile's counts (``torch.utils.flop_counter``: a multiply-add is two
FLOPs; forward and backward of every layer, attention included, re-computation not), so
TFLOP/s per device and MFU read as Megatron's and torchtitan's (which count
``6·N·tokens`` plus attention) where the profile counted every operation of the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.mesh.degree_figures import MeshLines
from autopipe.planning.model.plans import Plan
from autopipe.planning.schedules.interleaving import rank_stages, stage_rank
from autopipe.planning.schedules.simulation import hidden_alltoalls
from profiler import segments

__all__: list[str] = []

# A mesh's communication below this share of the step is not what a plan loses by.
_WORTH = 0.01
_KINDS = {"tensor": "tp", "context": "cp", "zero": "zero", "expert": "ep"}


def model_flops(space: Space, config: Config, batch: int) -> float:
    """FLOPs of a step of ``batch`` samples, forward and backward, as counted."""
    table = space.table
    size = config.mean_batch
    total = 0.0
    for what in ("flops", "backward_flops"):
        a, b = segments(space.lines.sizes, table.counts[what], size)
        total += float(np.maximum(a + b * size, 0.0).sum())
    return total / size * batch if size > 0 else 0.0


def mesh_parts(space: Space, config: Config, plan: Plan) -> dict[str, float]:
    """Seconds per step the busiest rank spends in each kind of exposed communication
    (its all-to-alls less what dualpipev's overlapped pairs hide)."""
    lines = space.lines_of(config)
    if not isinstance(lines, MeshLines):
        return {}
    k = plan.num_stages // plan.virtual_stages
    v = max(plan.virtual_stages, 1)
    rank = stage_rank(plan.bottleneck_stage, k, plan.schedule)  # the V placement's too
    m, size = plan.chunks, config.mean_batch
    exposure = lines.at(config.micro_batch, time_batch=size).exposure
    out = {}
    for kind, prefix in _KINDS.items():
        total = 0.0
        for stage in (plan.stages[j] for j in rank_stages(rank, k, v, plan.schedule)):
            if kind == "zero":  # by where the stage starts and ends
                if exposure is None:
                    continue
                forward, backward = map(float, exposure.exposed(stage.start, stage.stop))
            elif f"{prefix}_forward" not in lines.parts:
                continue  # no routed experts: no all-to-alls
            else:
                span = slice(stage.start, stage.stop)
                forward = float(lines.part(f"{prefix}_forward", size)[span].sum())
                backward = float(lines.part(f"{prefix}_backward", size)[span].sum())
            forward_share = stage.recompute / stage.forward if stage.forward > 0 else 0.0
            total += forward * (1 + forward_share) + backward
        total *= m
        if kind == "expert":  # less what dualpipev's overlapped pairs hide
            total -= hidden_alltoalls(plan)[rank]
        if total > 0:
            out[kind] = total
    return out


def fill_mesh_figures(
    plans: Sequence[Plan], configs: Sequence[Config], space: Space, sequence: int
) -> None:
    """Sets each plan's model FLOPs, the device's peak, its tokens per sample and its
    mesh's exposed communication (call :func:`explain_meshes` once the notes are made)."""
    roof = space.table.roofline
    counted = any(layer.flops is not None for layer in space.profile.layers)
    for plan, config in zip(plans, configs, strict=True):
        if counted:
            plan.model_flops = model_flops(space, config, plan.batch_size)
        plan.peak_flops = roof.peak_flops if roof is not None else 0.0
        plan.sequence = sequence
        plan.mesh_parts = mesh_parts(space, config, plan)


def mesh_line(plan: Plan, best: Plan, space: Space, config: Config) -> str:
    """Why ``plan``'s mesh costs more than the best's, in one line, or ``""``.

    Names the kind of communication that takes the most of the step beyond the best's,
    e.g. ``TP=8: 2 all-reduces per layer pass over 450 GB/s, 9% of the step`` or
    ``EP=64: 2 all-to-alls per MoE block pass over 50 GB/s, 12% of the step``.
    """
    if not plan.step_time:
        return ""
    excess = {
        kind: seconds - best.mesh_parts.get(kind, 0.0) for kind, seconds in plan.mesh_parts.items()
    }
    if not excess or max(excess.values()) <= 0:
        return ""
    kind = max(excess, key=lambda name: excess[name])
    share = plan.mesh_parts[kind] / plan.step_time
    if share < _WORTH:
        return ""
    groups, _ = space.group_links(config)
    mesh = plan.mesh
    if kind == "tensor":
        reductions = int(space.table.reductions.max()) if len(space.table.reductions) else 0
        link = groups.tensor
        plural = "s" if reductions != 1 else ""
        what = f"TP={mesh.tensor}: {reductions} all-reduce{plural} per layer pass"
    elif kind == "context":
        link = groups.context
        what = f"CP={mesh.context}: the key/value ring beyond attention"
    elif kind == "expert":
        link = groups.expert or groups.data
        what = f"EP={mesh.expert}: 2 all-to-alls per MoE block pass"
    else:
        link = groups.data
        what = f"ZeRO-{mesh.zero}: the per-unit exchanges beyond compute"
    rate = f" over {link.bandwidth / 1e9:.3g} GB/s" if link.bandwidth else ""
    return f"{what}{rate}, {share:.0%} of the step"


def explain_meshes(plans: Sequence[Plan], configs: Sequence[Config], space: Space) -> None:
    """Puts :func:`mesh_line` first in each runner-up's notes where its mesh costs more."""
    if not plans:
        return
    best = plans[0]
    for plan, config in zip(plans[1:], configs[1:], strict=True):
        line = mesh_line(plan, best, space, config)
        if line:
            plan.notes.insert(0, line)
