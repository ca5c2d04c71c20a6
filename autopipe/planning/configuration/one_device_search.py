"""The search when every stage takes turns on one device (``search(..., one_device=True)``).

In one process, K stages on one device run one after another: a step takes ``M · Σ c``
(:mod:`autopipe.planning.model.colocation`), the same for every split of a configuration,
and all K stages' memory is on that one device. So a configuration is K stages (at most
``devices``), M micro-batches and a checkpoint mode, run by GPipe's fill-drain in one
process; each is split as :func:`autopipe.plan` splits it with ``colocated=True`` (the
split whose largest stage needs the least memory), kept only when its stages together fit
the device, and valued by the plan's step. Replicas need devices of their own, and torch's
interleaved and zero-bubble runtimes run a stage per rank: neither is searched here.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopipe import PlanningError
from autopipe.planning.configuration.search_space import Bounds, Config, Space, configurations
from autopipe.planning.model.plans import Plan
from autopipe.planning.model.quantities import format_bytes, format_time
from autopipe.planning.planner import describe
from autopipe.planning.split.exact import memory_split
from autopipe.planning.split.tolerances import SAME_TIME
from profiler import Profile

__all__: list[str] = []


def check_one_device(
    schedules: Sequence[str], virtual_stages: Sequence[int], shard_optimizer: bool | str
) -> None:
    """Refuses the search dimensions that stages sharing one device do not have.

    Raises:
        ValueError: no ``gpipe`` among the schedules, virtual stages, or a sharded
            optimizer state (there are no replicas to shard it over).
    """
    if "gpipe" not in schedules:
        raise ValueError(
            "stages that take turns on one device run GPipe's fill-drain in one process; "
            "search the schedule gpipe"
        )
    if any(schedule in ("zbv", "dualpipev") for schedule in schedules):
        raise ValueError(
            "stages that take turns on one device run GPipe's fill-drain in one process, not "
            "zbv or dualpipev (the distributed runner's); search the schedule gpipe"
        )
    if any(v != 1 for v in virtual_stages):
        raise ValueError(
            "stages that take turns on one device run no interleaved virtual stages; leave "
            "out virtual_stages (--virtual-stages)"
        )
    if shard_optimizer is not False:
        raise ValueError(
            "one device holds one replica, with no copies to shard the optimizer state over; "
            "leave out shard_optimizer (--shard-optimizer)"
        )


def one_device_search(
    profile: Profile,
    space: Space,
    devices: int,
    batch: int,
    checkpoints: Sequence[str],
    *,
    top: int,
    max_chunks: int | None,
    even: bool,
    optimizer: str | float,
) -> list[Plan]:
    """Up to ``top`` plans of at most ``devices`` stages on one device, fastest first.

    Ties go to fewer stages, then to less memory on the device.

    Raises:
        PlanningError: no configuration fits; the message names the closest.
    """
    configs = [
        c
        for c in configurations(
            Bounds(devices, len(profile), batch, checkpoints, ("gpipe",), max_chunks), even
        )
        if c.replicas == 1
    ]
    record = profile.to_dict()
    found: list[tuple[tuple[float, ...], Plan]] = []
    short: tuple[float, Config] | None = None  # the least memory missing, and where
    for config in configs:
        model = space.model(config)
        try:
            balance = memory_split(model)
        except PlanningError:
            continue
        plan = describe(model, balance, profile, "optimal", optimizer, batch=batch, record=record)
        held = sum(stage.memory for stage in plan.stages)
        if space.capacity is not None and held > space.capacity:
            missing = held - space.capacity
            if short is None or missing < short[0]:
                short = (missing, config)
            continue
        checkpoint = checkpoints.index(config.checkpoint)
        found.append(((plan.step_time, config.stages, held, checkpoint, config.chunks), plan))
    if not found:
        raise PlanningError(_no_fit(space, configs, short, devices))
    found.sort(key=lambda item: item[0])
    plans = [plan for _, plan in found[:top]]
    _annotate(plans, len(configs), devices, space.profile.device)
    return plans


def _held(plan: Plan) -> float:
    return sum(stage.memory for stage in plan.stages)


def _annotate(plans: list[Plan], count: int, devices: int, device: str) -> None:
    best = plans[0]
    best.notes = [
        f"best of {count} configurations of up to {devices} stages taking turns on one "
        f"{device}: every split of one takes the same time, so each is split for the least "
        "memory per stage"
    ]
    for plan in plans[1:]:
        if plan.step_time <= best.step_time * (1 + SAME_TIME):
            plan.notes = [
                f"ties with the best; {format_bytes(_held(plan))} on the device vs "
                f"{format_bytes(_held(best))}"
            ]
            continue
        slower = plan.step_time / best.step_time if best.step_time > 0 else float("inf")
        recompute = plan.chunks * sum(stage.recompute for stage in plan.stages)
        theirs = best.chunks * sum(stage.recompute for stage in best.stages)
        reasons = []
        if plan.chunks != best.chunks:
            reasons.append(f"{plan.chunks} micro-batches vs {best.chunks}")
        if recompute > theirs:
            reasons.append(f"re-computation {format_time(recompute)} vs {format_time(theirs)}")
        overhead = plan.chunks * sum(stage.overhead for stage in plan.stages)
        if overhead > best.chunks * sum(stage.overhead for stage in best.stages):
            reasons.append(f"executor overhead {format_time(overhead)}")
        if not reasons:  # the layers' own times at another micro-batch size
            reasons.append(f"micro-batches of {plan.micro_batch} vs {best.micro_batch}")
        plan.notes = [f"{slower:.2f}x the best step: " + ", ".join(reasons)]


def _no_fit(
    space: Space, configs: Sequence[Config], short: tuple[float, Config] | None, devices: int
) -> str:
    capacity = format_bytes(space.capacity or 0)
    if short is None:
        return (
            f"no configuration of up to {devices} stages on one device fits its {capacity}: "
            "some layer does not fit alone; add memory, checkpoint or use a smaller batch"
        )
    missing, config = short
    return (
        f"no configuration of up to {devices} stages on one device fits its {capacity}: the "
        f"closest, {config.label()}, needs {format_bytes(missing)} more for its stages "
        "together; add memory, checkpoint or use a smaller batch"
    )
