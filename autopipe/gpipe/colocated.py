"""Partitions on one physical device: found by the device, not by its name.

In one process, two partitions on ``cpu`` (or on ``cuda`` and ``cuda:0`` when device 0 is
the current one) run their micro-batches on the same cores or GPU, one after another; the
planner prices that only when it is told (``colocated=True``) and the names agree. The
runners name each stage's device as :func:`profiler.devices.physical_device` resolves it,
and :meth:`autopipe.GPipe.from_plan` checks a plan against the devices it will run on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopipe.planning import Plan, colocated_plan, format_time
from profiler import physical_device

__all__: list[str] = []

Device = torch.device | str | int


def physical_names(devices: Sequence[Device]) -> list[str]:
    """Each device's name as its physical device: ``cpu``, ``cuda:0``, ..."""
    return [str(physical_device(device)) for device in devices]


def device_groups(devices: Sequence[Device]) -> list[list[int]]:
    """The partitions that share a physical device: groups of two or more indices."""
    by_device: dict[str, list[int]] = {}
    for k, name in enumerate(physical_names(devices)):
        by_device.setdefault(name, []).append(k)
    return [group for group in by_device.values() if len(group) > 1]


def colocation_mismatch(plan: Plan, devices: Sequence[Device]) -> str | None:
    """Why ``plan`` mispredicts the pipeline on ``devices``, or ``None`` when its stages
    share devices as they will there (``plan.shared``)."""
    groups = device_groups(devices)
    if sorted(map(sorted, plan.shared)) == sorted(groups):
        return None
    names = physical_names(devices)
    if groups:
        which = "; ".join(f"stages {', '.join(map(str, g))} share {names[g[0]]}" for g in groups)
        step = "longer"  # a plan without stage figures, or one no single process prices
        single = plan.virtual_stages == 1 and plan.schedule != "zb" and plan.data_parallel == 1
        if plan.stages and single:
            step = f"at least {format_time(colocated_plan(plan, groups).step_time)}"
        return (
            f"the plan predicts a step of {format_time(plan.step_time)} for stages on "
            f"devices of their own, but {which} and run one after another, which takes "
            f"{step}; plan with colocated=True (autopipe.wrap does) to predict them"
        )
    return (
        "the plan has stages sharing a device, but they run on devices of their own here; "
        "plan for these devices without colocated=True to predict them"
    )
