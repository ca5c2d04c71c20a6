"""Stages that share one device: they take turns on it, so their work adds up.

In one process, GPipe's partitions on the same device (``['cpu', 'cpu']``, or two
partitions on one GPU) run their micro-batches on the same cores or the same GPU: while
one computes, the other waits for the device, not for its input. The fill–drain formula
``Σ c + (M−1)·max c`` assumes K devices working at once and so predicts a step K times
shorter than a device can do its stages' work. A device busy with every micro-batch of
each of its stages needs at least ``M · Σ_{k on it} c_k``, and the pipeline's own
dependencies still hold, so the step is the larger of the two::

    T = max(Σ_k c_k + (M − 1) · max_k c_k,  max_d M · Σ_{k on d} c_k)

With every stage on one device that is ``M · Σ c``: every split costs the same time
(the work is the same), and only memory tells splits apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.plans import Plan

__all__ = ["colocated_plan"]


def shared_groups(devices: Sequence[DeviceSpec], colocated: bool) -> list[list[int]]:
    """The stages that share a device: groups of two or more stage indices whose devices
    have the same name, when the stages run in one process (``colocated``); else none.

    Ranks each run their own process on their own device (a CPU share, a GPU), whatever
    the names say, so only a single-process runner co-locates stages.
    """
    if not colocated:
        return []
    by_name: dict[str, list[int]] = {}
    for k, device in enumerate(devices):
        by_name.setdefault(device.name, []).append(k)
    return [group for group in by_name.values() if len(group) > 1]


def device_count(stages: int, groups: Sequence[Sequence[int]]) -> int:
    """Distinct devices of ``stages`` stages, those in each group counting once."""
    return stages - sum(len(group) - 1 for group in groups)


def shared_step_time(times: Sequence[float], chunks: int, groups: Sequence[Sequence[int]]) -> float:
    """The pipeline's step when the stages of each group take turns on one device.

    Args:
        times: each stage's cost per micro-batch.
        chunks: micro-batches per step (M).
        groups: the stages sharing a device (:func:`shared_groups`).
    """
    pipeline = float(sum(times)) + (chunks - 1) * float(max(times))
    busiest = max((chunks * sum(times[k] for k in group) for group in groups), default=0.0)
    return max(pipeline, busiest)


def colocated_plan(plan: Plan, groups: Sequence[Sequence[int]]) -> Plan:
    """``plan`` priced with the stages of each group taking turns on one device.

    A stage's own time does not depend on which stages share its device, so the stages are
    kept and only the step, the bubble and the throughput are priced again (as
    :func:`autopipe.plan` prices them with ``colocated=True``): for a plan made for devices
    of their own that a single-process runner puts on fewer devices.

    Raises:
        ValueError: the plan has virtual stages, zero bubble or replicas, which no
            single-process runner co-locates.
    """
    shared = [sorted(int(k) for k in group) for group in groups if len(group) > 1]
    if shared and (plan.virtual_stages > 1 or plan.schedule == "zb" or plan.data_parallel > 1):
        raise ValueError(
            "stages sharing a device are planned for the single-process GPipe, which runs "
            "neither virtual stages, zero bubble nor replicas"
        )
    times = [stage.time for stage in plan.stages]
    m = plan.chunks
    pipeline = shared_step_time(times, m, shared)
    total = pipeline + plan.allreduce + plan.tied_time
    devices = device_count(plan.num_stages, shared)
    bubble = 1.0 - m * float(sum(times)) / (devices * pipeline) if pipeline > 0 else 0.0
    throughput = plan.batch_size / total if total > 0 else 0.0
    return dataclasses.replace(
        plan, shared=shared, step_time=total, bubble=bubble, throughput=throughput
    )
