"""Why each configuration of a :func:`autopipe.search` loses to the best, in words."""

from __future__ import annotations

from collections.abc import Sequence

from autopipe.planning.configuration.search_space import Config, Space
from autopipe.planning.model.plans import Plan
from autopipe.planning.model.quantities import format_bytes, format_time
from autopipe.planning.split.screening import Relaxation
from autopipe.planning.split.tolerances import SAME_TIME

__all__ = []

# Faster configurations that do not fit, named on the best plan.
_UNFIT_NOTES = 3


def _devices(n: int) -> str:
    return f"{n} device{'' if n == 1 else 's'}"


def breakdown(plan: Plan) -> dict[str, float]:
    """The step time in parts (seconds) that add up to ``plan.step_time``.

    ``work`` is a device's own compute (``M·mean c`` less re-computation), ``recompute``
    the re-computed forwards, ``bubble`` the pipeline's fill and drain
    (``(K−1)·mean c``), ``imbalance`` the wait on the slowest stage
    (``(M−1)·(max c − mean c)``), ``allreduce`` the gradient all-reduce and, when
    there are any, ``tied`` the sums of tied parameters' gradients. With v
    virtual stages per device, ``mean c`` is a device's share ``Σc / K``, the fill and
    drain shrink to ``(K−1)·Σc / (K·v)``, and ``imbalance`` is what the replayed
    schedule takes beyond both.
    """
    k, m, v = plan.num_stages, plan.chunks, max(plan.virtual_stages, 1)
    ranks = k // v
    mean = sum(stage.time for stage in plan.stages) / ranks
    recompute = m * sum(stage.recompute for stage in plan.stages) / ranks
    if v == 1:
        bubble, imbalance = (k - 1) * mean, (m - 1) * (plan.bottleneck - mean)
    else:
        pipeline = plan.step_time - plan.allreduce - plan.tied_time - m * mean
        bubble = min((ranks - 1) * mean / v, pipeline)
        imbalance = pipeline - bubble
    parts = {
        "work": m * mean - recompute,
        "recompute": recompute,
        "bubble": bubble,
        "imbalance": imbalance,
        "allreduce": plan.allreduce,
    }
    if plan.tied_time > 0:
        parts["tied"] = plan.tied_time
    return parts


def _peak(plan: Plan) -> float:
    return max(stage.memory for stage in plan.stages)


def why_slower(plan: Plan, best: Plan) -> str:
    """One line on why ``plan`` predicts a longer step than ``best``."""
    if plan.step_time <= best.step_time * (1 + SAME_TIME):
        same = "ties with the best"
        if plan.num_devices != best.num_devices:
            return f"{same} on {_devices(plan.num_devices)} vs {best.num_devices}"
        return f"{same}; peak memory {format_bytes(_peak(plan))} vs {format_bytes(_peak(best))}"
    mine, theirs = breakdown(plan), breakdown(best)
    for part in {*mine, *theirs}:  # a part only one of them has is 0 in the other
        mine.setdefault(part, 0.0)
        theirs.setdefault(part, 0.0)
    worse = sorted(mine, key=lambda part: theirs[part] - mine[part])
    reasons: list[str] = []
    for part in worse[:2]:
        delta = mine[part] - theirs[part]
        if delta <= 0.05 * (plan.step_time - best.step_time) and reasons:
            break
        if part == "bubble":
            reasons.append(f"bubble {plan.bubble:.0%} vs {best.bubble:.0%}")
        elif part == "work":
            text = f"work {format_time(mine[part])} per device vs {format_time(theirs[part])}"
            if plan.num_devices != best.num_devices:
                text += f" ({_devices(plan.num_devices)} vs {best.num_devices})"
            elif plan.chunks > best.chunks:
                text += f" ({plan.chunks} micro-batches vs {best.chunks})"
            reasons.append(text)
        else:
            label = {
                "recompute": "re-computation",
                "imbalance": "stage imbalance",
                "tied": "tied gradient sums",
            }
            name = label.get(part, "all-reduce")
            reasons.append(f"{name} {format_time(mine[part])} vs {format_time(theirs[part])}")
    slower = plan.step_time / best.step_time if best.step_time > 0 else float("inf")
    return f"{slower:.2f}x the best step: " + ", ".join(reasons)


def annotate(
    plans: list[Plan],
    space: Space,
    infeasible: Sequence[tuple[float, Config]],
    stats: dict[str, int],
    devices: int,
) -> None:
    """Fills every plan's ``notes``: why it loses to the best, or, on the best, the search."""
    best = plans[0]
    for plan in plans[1:]:
        plan.notes = [why_slower(plan, best)]
    interleaved = stats.get("interleaved", 0)
    replayed = f", {interleaved} interleaved by replayed schedules" if interleaved else ""
    best.notes = [
        f"best of {stats['configurations']} configurations of up to {devices} devices: "
        f"{stats['relaxed']} bounded by relaxed partitions, {stats['intervals']} solved by "
        f"interval search and {stats['exact']} by dynamic programming{replayed}, the rest "
        "pruned"
    ]
    if (
        space.allreduce is None
        and space.links is None
        and any(plan.data_parallel > 1 for plan in plans)
    ):
        best.notes.append(
            "gradient all-reduce counted as free: give allreduce_bandwidth (or bandwidth) "
            "to weigh data parallelism"
        )
    named: set[tuple[int, int]] = set()
    for bound, config in infeasible:
        if bound >= best.step_time * (1 - SAME_TIME) or len(named) >= _UNFIT_NOTES:
            break
        if (config.stages, config.replicas) in named:
            continue
        missing = Relaxation(space.model(config), space.memory_ends).shortfall()
        if missing <= 0:  # a rank's stages together, not one stage, are over its device
            continue
        named.add((config.stages, config.replicas))
        faster = best.step_time / bound if bound > 0 else float("inf")
        best.notes.append(
            f"{config.label()} could be up to {faster:.2f}x faster but needs at least "
            f"{format_bytes(missing)} more than the {format_bytes(space.capacity or 0)} per device"
        )


def explain_infeasible(space: Space, configs: Sequence[Config], devices: int) -> str:
    """Why no configuration fits, naming the closest of the least memory-hungry ones."""
    deepest = max(config.stages for config in configs)
    order = ("always", "except_last", "auto", "never")
    candidates = [c for c in configs if c.stages == deepest and c.replicas == 1]
    candidates = candidates or [c for c in configs if c.stages == deepest]
    mode = min((c.checkpoint for c in candidates), key=order.index)
    schedules = [c.schedule for c in candidates if c.checkpoint == mode]
    schedule = "1f1b" if "1f1b" in schedules else schedules[0]  # e.g. only dualpipev
    chosen = [c for c in candidates if c.checkpoint == mode and c.schedule == schedule]
    chosen.sort(key=lambda c: c.chunks)
    picks = {chosen[0], chosen[len(chosen) // 2], chosen[-1]}
    missing, closest = min(
        ((Relaxation(space.model(c), space.memory_ends).shortfall(), c) for c in picks),
        key=lambda x: x[0],
    )
    fixes = "add memory or devices, or use a smaller batch"
    zero = {c.zero for c in configs}
    if max(zero) >= 0:  # a mesh search: its ZeRO stages shard the replicas' state
        if max(zero) < 3:
            fixes = (
                "add memory or devices, use a smaller batch, or shard more of the state "
                "over the replicas (--zero 2,3)"
            )
    elif space.optimizer > 0 and not space.shard_optimizer and devices > 1:
        # Replicas could shard the optimizer state (ZeRO-1).
        fixes = (
            "add memory or devices, use a smaller batch, or shard the optimizer state over "
            "the replicas (--shard-optimizer, shard_optimizer=True)"
        )
    if missing > 0:
        closest_says = f"needs at least {format_bytes(missing)} more per device"
    else:  # a lower bound that passes: the stages cut whole layers, and none fits
        closest_says = (
            "holds no more than a device in all, but no split of its layers into its "
            "stages fits each device"
        )
    return (
        f"no configuration of up to {devices} devices fits {format_bytes(space.capacity or 0)} "
        f"per device: the closest, {closest.label()}, {closest_says}; {fixes}"
    )
