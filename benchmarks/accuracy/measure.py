"""Measures what the planner predicts for a plan: step time and peak memory per stage."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from autopipe.planning.model.plans import Plan
from profiler.live_memory import SavedMemory

__all__ = ["compare", "distinct", "interleaved_medians", "stage_memory", "state_bytes"]


def distinct(plans: list[Plan]) -> list[Plan]:
    """The ranked plans, each configuration that runs differently once (best rank kept)."""
    seen, out = set(), []
    for plan in plans:
        schedule = plan.schedule if plan.num_stages > 1 else "-"  # one stage: no schedule
        key = (plan.num_stages, plan.data_parallel, plan.chunks, plan.checkpoint, schedule)
        if key not in seen:
            seen.add(key)
            out.append(plan)
    return out


def state_bytes(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, their gradients, the optimizer's state and buffers."""
    params = {id(p): p for m in modules for p in m.parameters()}
    buffers = {id(b): b for m in modules for b in m.buffers()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    total += sum(
        p.grad.numel() * p.grad.element_size() for p in params.values() if p.grad is not None
    )
    total += sum(b.numel() * b.element_size() for b in buffers.values())
    for key, state in optimizer.state.items():
        if id(key) in params:
            for value in state.values():
                # Adam's step counter is a 0-d tensor: not per-parameter state.
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total += value.numel() * value.element_size()
    return total


def stage_memory(
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    device: torch.device | None = None,
) -> dict[str, int]:
    """Runs ``step`` (forward + backward) once, then the optimizer, and measures memory.

    On CUDA the step's own peak comes from the allocator: what it allocated above what
    was resident before it (every model copy's state, this one's gradients and optimizer
    state included), which counts transient buffers too.

    Returns:
        ``{"state": bytes, "activations": peak saved bytes, "total": state + the step's
        peak (CUDA) or + the saved bytes (elsewhere)}``.
    """
    optimizer.zero_grad(set_to_none=False)
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    with SavedMemory.of_modules(*modules) as saved:
        step()
    extra = saved.peak
    if cuda:
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
    optimizer.step()
    state = state_bytes(modules, optimizer)
    return {"state": state, "activations": saved.peak, "total": state + extra}


def interleaved_medians(
    steps: dict[str, Callable[[], float]], repeats: int, warmup: int, seed: int = 0
) -> dict[str, float]:
    """Median seconds of each step, run round-robin in a new order each round.

    Each callable runs one step and returns its seconds (so it can exclude untimed work).
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    shuffle = random.Random(seed).shuffle
    for i in range(warmup + repeats):
        shuffle(order)
        for name in order:
            took = steps[name]()
            if i >= warmup:
                times[name].append(took)
    return {name: statistics.median(values) for name, values in times.items()}


def timed(function: Callable[[], Any], device: torch.device | None = None) -> float:
    """Seconds of ``function()``, waiting for a CUDA device to finish its work."""
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    function()
    if cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def compare(plan: Plan, measured_s: float, memory: list[dict[str, int]]) -> dict[str, Any]:
    """One row: the plan's predictions next to the measurements."""
    predicted_memory = [float(s.memory) for s in plan.stages]
    measured_memory = [float(m["total"]) for m in memory]
    return {
        "stages": plan.num_stages,
        "data_parallel": plan.data_parallel,
        "chunks": plan.chunks,
        "checkpoint": plan.checkpoint,
        "schedule": plan.schedule,
        "balance": plan.balance,
        "predicted_s": plan.step_time,
        "measured_s": measured_s,
        "time_ratio": plan.step_time / measured_s,
        "predicted_memory": predicted_memory,
        "measured_memory": measured_memory,
        "measured_activations": [m["activations"] for m in memory],
        "memory_ratio": [
            p / m if m else float("nan") for p, m in zip(predicted_memory, measured_memory)
        ],
    }
