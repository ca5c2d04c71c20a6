"""``plan``: a profile and devices in, the fastest split that fits out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autopipe.balance import STRATEGIES, baseline_balance
from autopipe.cost_model import CostModel, LayerCosts, optimizer_factor
from autopipe.devices import DeviceSpec, make_devices
from autopipe.errors import PlanningError
from autopipe.exact import optimal_split, step_time
from autopipe.plans import Plan, StagePlan
from autopipe.units import format_bytes
from profiler.profile import Profile

__all__ = ["build_model", "evaluate", "plan"]

MemorySpec = int | str | Sequence[int | str | None] | None


def build_model(
    profile: Profile,
    devices: int | Sequence[DeviceSpec | str] = 2,
    *,
    chunks: int | None = None,
    memory: MemorySpec = None,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    optimizer: str | float = "adam",
    bandwidth: float | None = None,
) -> CostModel:
    """The cost model :func:`plan` optimizes, for the same arguments."""
    specs = make_devices(devices, memory=memory, bandwidth=bandwidth, name=profile.device)
    m = profile.chunks if chunks is None else chunks
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"chunks must be a positive integer, got {m!r}")
    micro = math.ceil(profile.batch_size / m)
    # A mini-batch smaller than M yields fewer, single-sample micro-batches.
    effective = math.ceil(profile.batch_size / micro)
    costs = LayerCosts.from_profile(profile, micro)
    return CostModel(costs, specs, effective, checkpoint, schedule, optimizer_factor(optimizer))


def plan(
    profile: Profile,
    devices: int | Sequence[DeviceSpec | str] = 2,
    *,
    chunks: int | None = None,
    memory: MemorySpec = None,
    checkpoint: str = "except_last",
    schedule: str = "gpipe",
    strategy: str = "optimal",
    optimizer: str | float = "adam",
    bandwidth: float | None = None,
) -> Plan:
    """Plans the pipeline with the smallest predicted step time that fits every device.

    Args:
        profile: per-layer measurements (see :func:`profiler.profile_model`).
        devices: the number of stages (identical devices named like the profile's), or one
            :class:`DeviceSpec` or device name per stage.
        chunks: micro-batches per mini-batch (default: the profile's).
        memory: capacity for every device, or one per device (bytes or ``16GiB``-style).
        checkpoint: ``always``, ``except_last`` (default) or ``never``.
        schedule: ``gpipe`` (default) or ``1f1b``; sets how many micro-batches each stage
            holds.
        strategy: ``optimal`` (exact, default), or a comparison strategy: ``uniform``,
            ``parameters``, ``blockpartition``.
        optimizer: optimizer whose state is counted (``adam``, ``sgd``, ...) or state bytes
            per parameter byte.
        bandwidth: link bandwidth in bytes/s for devices without one (default: free).

    Raises:
        PlanningError: no split fits, or the chosen strategy's split does not fit; the
            message names the stage or layer and the bytes missing.
        ValueError: invalid arguments.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    model = build_model(
        profile,
        devices,
        chunks=chunks,
        memory=memory,
        checkpoint=checkpoint,
        schedule=schedule,
        optimizer=optimizer,
        bandwidth=bandwidth,
    )
    if model.num_stages > model.num_layers:
        raise PlanningError(
            f"cannot split {model.num_layers} layers into {model.num_stages} non-empty stages; "
            f"use at most {model.num_layers} stages"
        )
    if strategy == "optimal":
        balance = optimal_split(model)
    else:
        params = model.layers.params + model.layers.buffers
        balance = baseline_balance(strategy, model.layer_time(), model.num_stages, params)
    result = describe(model, balance, profile, strategy, optimizer)
    over = [s for s in result.stages if s.capacity is not None and s.memory > s.capacity]
    if over:
        worst = max(over, key=lambda s: s.memory - (s.capacity or 0))
        raise PlanningError(
            f"the {strategy} split {balance} does not fit: stage {worst.index} "
            f"(layers {worst.layers[0]}..{worst.layers[-1]}) needs "
            f"{format_bytes(worst.memory - (worst.capacity or 0))} more than its "
            f"{format_bytes(worst.capacity or 0)}"
        )
    return result


def evaluate(
    profile: Profile,
    balance: Sequence[int],
    devices: int | Sequence[DeviceSpec | str] | None = None,
    *,
    strategy: str = "given",
    optimizer: str | float = "adam",
    **kwargs: object,
) -> Plan:
    """Predicts the costs of a given balance without checking that it fits.

    Takes the same keyword arguments as :func:`plan`; ``devices`` defaults to
    ``len(balance)`` stages.
    """
    model = build_model(
        profile,
        len(balance) if devices is None else devices,
        optimizer=optimizer,
        **kwargs,  # type: ignore[arg-type]
    )
    if len(balance) != model.num_stages:
        raise ValueError(f"balance has {len(balance)} stages but there are {model.num_stages}")
    if sum(balance) != model.num_layers or min(balance) < 1:
        raise ValueError(
            f"balance {list(balance)} must have entries >= 1 summing to {model.num_layers}"
        )
    return describe(model, list(balance), profile, strategy, optimizer)


def describe(
    model: CostModel,
    balance: list[int],
    profile: Profile,
    strategy: str,
    optimizer: str | float,
) -> Plan:
    """Builds the :class:`Plan` record of ``balance`` under ``model``."""
    bounds = np.cumsum([0, *balance])
    stages = []
    for k in range(model.num_stages):
        s, e = np.array(bounds[k]), np.array(bounds[k + 1])
        compute = float(model.compute_time(k, s, e))
        transfer = float(model.transfer_time(k, e))
        state = float(model.state_memory(s, e))
        activations = float(model.activation_memory(k, s, e))
        capacity = model.devices[k].memory
        stages.append(
            StagePlan(
                index=k,
                device=model.devices[k].name,
                start=int(s),
                stop=int(e),
                layers=model.layers.names[int(s) : int(e)],
                compute=compute,
                transfer=transfer,
                time=compute + transfer,
                memory=state + activations,
                param_memory=state,
                activation_memory=activations,
                capacity=capacity,
                in_flight=model.in_flight(k),
            )
        )
    times = np.array([stage.time for stage in stages])
    m = model.chunks
    total = step_time(times, m)
    # Idle share of K devices over the step; (K−1)/(M+K−1) when stages are balanced.
    bubble = 1.0 - m * float(times.sum()) / (len(stages) * total) if total > 0 else 0.0
    return Plan(
        balance=list(balance),
        stages=stages,
        chunks=m,
        micro_batch=math.ceil(profile.batch_size / m),
        checkpoint=model.checkpoint,
        schedule=model.schedule,
        strategy=strategy,
        optimizer=str(optimizer),
        bottleneck=float(times.max()),
        bottleneck_stage=int(np.argmax(times)),
        step_time=total,
        bubble=bubble,
        devices=list(model.devices),
        profile=profile.to_dict(),
    )
