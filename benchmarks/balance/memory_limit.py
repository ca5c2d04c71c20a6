"""A per-device memory limit that binds the optimal plan yet still fits, found by bisection."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from autopipe import Plan, PlanningError, plan
from profiler.profile import Profile

__all__ = ["MARGIN", "MemoryLimit", "choose_limit", "least_capacity", "peak_memory"]

# How far above the least feasible capacity the limit sits: tight enough that the
# constraint shapes the split, loose enough that it is not a knife-edge of float rounding.
MARGIN = 1.05


@dataclass(frozen=True)
class MemoryLimit:
    """The limit chosen for one profile and stage count.

    Attributes:
        least: smallest per-device capacity (bytes) at which the planner finds a plan.
        unconstrained_peak: largest stage memory (bytes) of the unconstrained optimal plan.
        limit: the per-device capacity to plan with.
        binding: whether ``limit < unconstrained_peak``, i.e. the unconstrained optimal split
            does not fit under it. False only when that split already needs the least
            memory, so no feasible limit can bind.
        probes: planner calls the bisection made.
        seconds: wall-clock time of the whole search.
    """

    least: int
    unconstrained_peak: float
    limit: int
    binding: bool
    probes: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)


def peak_memory(p: Plan) -> float:
    """The plan's largest per-stage memory as the planner charges it, in bytes.

    That is parameters, gradients, optimizer state, buffers, boundary inputs, saved
    activations and the transient peak (:class:`autopipe.planning.model.plans.StagePlan`
    ``memory``).
    """
    return max(s.memory for s in p.stages)


def _fits(profile: Profile, stages: int, capacity: int, options: dict[str, Any]) -> bool:
    try:
        plan(profile, stages, memory=capacity, **options)
    except PlanningError:
        # The planner's "nothing fits" error. Other ValueErrors are bad arguments and must
        # not be mistaken for "too small", so only this subclass is caught.
        return False
    return True


def least_capacity(profile: Profile, stages: int, high: int, **options: Any) -> tuple[int, int]:
    """The smallest integer capacity at which :func:`autopipe.plan` finds a split.

    Feasibility is monotone in the capacity (a split that fits a capacity fits every larger
    one, and the planner is exact), so bisection on ``[0, high]`` finds the threshold.

    Args:
        profile: the model's profile.
        stages: number of stages K.
        high: a capacity at which a plan exists, in bytes.
        **options: further :func:`autopipe.plan` keywords (chunks, checkpoint, ...).

    Returns:
        ``(least, probes)``: the capacity in bytes and the number of planner calls made.

    Raises:
        ValueError: no plan exists even at ``high``.
    """
    probes = 1
    if not _fits(profile, stages, high, options):
        raise ValueError(f"no split into {stages} stages fits {high} bytes per device")
    low = -1  # invariant: low does not fit (a negative capacity is not even tried), high fits
    while high - low > 1:
        mid = (low + high) // 2
        probes += 1
        if _fits(profile, stages, mid, options):
            high = mid
        else:
            low = mid
    return high, probes


def choose_limit(
    profile: Profile, stages: int, *, margin: float = MARGIN, **options: Any
) -> MemoryLimit:
    """A per-device limit that the unconstrained optimal split exceeds but some split meets.

    The limit is ``margin`` x the least feasible capacity; when that is not strictly below
    the unconstrained optimal plan's peak stage memory, it is the midpoint between the two,
    so the constraint still binds. When the unconstrained optimal split already needs the
    least memory, the limit is that least capacity and ``binding`` is False.

    Args:
        profile: the model's profile.
        stages: number of stages K.
        margin: factor above the least feasible capacity, at least 1.
        **options: further :func:`autopipe.plan` keywords (chunks, checkpoint, ...), the
            same that the memory-aware plan will be made with.

    Returns:
        The :class:`MemoryLimit`.
    """
    if margin < 1:
        raise ValueError(f"margin must be at least 1, got {margin}")
    begin = time.perf_counter()
    peak = peak_memory(plan(profile, stages, **options))
    least, probes = least_capacity(profile, stages, math.ceil(peak), **options)
    below_peak = math.ceil(peak) - 1  # the largest integer capacity strictly below the peak
    if below_peak < least:
        limit, binding = least, False
    else:
        limit = math.floor(least * margin)
        if limit > below_peak:
            limit = (least + below_peak) // 2
        binding = True
    return MemoryLimit(least, peak, limit, binding, probes, time.perf_counter() - begin)
