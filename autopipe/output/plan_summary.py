"""What a plan's report says of it in one cell: each device's peak memory, the checkpoint
mode (the stage report and the ranked tables of a search alike)."""

from __future__ import annotations

from autopipe.planning import Plan, rank_stages

__all__: list[str] = []


def checkpoint_label(plan: Plan) -> str:
    """The checkpoint mode; for ``auto``, which stages checkpoint, e.g. ``auto (1 of 4)``;
    with the norms or the up-projections re-computed (:attr:`Plan.recompute_norms`,
    :attr:`Plan.recompute_up_proj`), that too."""
    asked = {"norms": plan.recompute_norms, "up-projections": plan.recompute_up_proj}
    parts = [what for what, flag in asked.items() if flag]
    norms = f" + {' and '.join(parts)} re-computed" if parts else ""
    if plan.checkpoint != "auto":
        return plan.checkpoint + norms
    chosen = sum(mode != "never" for mode in plan.stage_checkpoints)
    return f"auto ({chosen} of {plan.num_stages} stages checkpoint){norms}"


def device_memory(plan: Plan) -> list[float]:
    """Each device's predicted peak bytes: with virtual stages, or stages sharing a
    device (``plan.shared``), its stages' together."""
    virtual = max(plan.virtual_stages, 1)
    ranks = plan.num_stages // virtual
    if plan.device_memory and not plan.shared:  # the ranks' peaks, as the planner holds them
        return list(plan.device_memory)
    held = [
        sum(plan.stages[k].memory for k in rank_stages(r, ranks, virtual, plan.schedule))
        for r in range(ranks)
    ]
    grouped = {k for group in plan.shared for k in group}
    shared = [sum(plan.stages[k].memory for k in group) for group in plan.shared]
    return [m for r, m in enumerate(held) if r not in grouped] + shared
