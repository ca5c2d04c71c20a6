"""The numbers of a measured step benchmark: median and spread, prediction, the ideal bound."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from autopipe.planning import Plan, PlanSettings, build_model
from profiler import Profile

__all__ = [
    "Measured",
    "bench_record",
    "ideal_step",
    "merge_stage_seconds",
    "summarize",
    "unit_costs",
]


@dataclass(frozen=True)
class Measured:
    """What a runner measured of one split.

    Attributes:
        times: seconds of each timed training step, the warm-up steps left out.
        saved_peak: per stage, the peak bytes saved for backward over a step (the
            activations a stage holds), ``None`` where it was not measured.
        in_place: a warm-up step recorded where it ran (see :func:`merge_stage_seconds`),
            or ``None``.
    """

    times: list[float]
    saved_peak: list[int | None]
    in_place: dict[str, Any] | None = None


def merge_stage_seconds(parts: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Every rank's recorded step as one: each stage's figures from the rank that ran it,
    the slowest rank's step and recorded span, and, where the ranks timed unrecorded
    steps (``steps``), the slowest rank's seconds of each; ``None`` when a rank recorded
    none."""
    if not parts or any(part is None for part in parts):
        return None
    stages: dict[int, dict[str, float]] = {}
    for part in parts:
        stages.update({int(k): dict(v) for k, v in part["stages"].items()})  # type: ignore[index]
    merged: dict[str, Any] = {
        "stages": [stages[i] for i in sorted(stages)],
        "step": max(part["step"] for part in parts),  # type: ignore[index]
        "span": max(part["span"] for part in parts),  # type: ignore[index]
    }
    lists = [part.get("steps") for part in parts]  # type: ignore[union-attr]
    if all(lists) and len({len(found) for found in lists}) == 1:  # type: ignore[arg-type]
        # The same steps on every rank: each one's seconds is its slowest rank's.
        merged["steps"] = [max(seconds) for seconds in zip(*lists, strict=True)]
    return merged


def median_spread(times: Sequence[float]) -> tuple[float, float]:
    """The median of ``times`` and their spread, the interquartile range over the median.

    Raises:
        ValueError: no times.
    """
    if not times:
        raise ValueError("no step times to summarize")
    values = np.asarray(times, dtype=float)
    median = float(np.median(values))
    q1, q3 = np.percentile(values, [25, 75])
    return median, float(q3 - q1) / median if median > 0 else 0.0


def ideal_step(stage_times: Sequence[float], chunks: int, devices: int | None = None) -> float:
    """The step of the same total work spread perfectly over the devices.

    With ``c`` the per-micro-batch stage costs, K stages and M micro-batches, GPipe's step
    ``Σc + (M−1)·max c`` is smallest when every stage costs ``Σc/K``: ``Σc/K·(M+K−1)``.
    Stages that take turns on fewer devices (``devices`` n < K, in one process) spread
    the work over those: ``Σc/n·(M+n−1)``, ``M·Σc`` on one.

    Raises:
        ValueError: no stages, or fewer than one micro-batch.
    """
    if not stage_times:
        raise ValueError("the ideal step needs at least one stage")
    if chunks < 1:
        raise ValueError(f"the ideal step needs at least one micro-batch, got {chunks}")
    k = len(stage_times) if devices is None else min(devices, len(stage_times))
    if k < 1:
        raise ValueError(f"the ideal step needs at least one device, got {devices}")
    return float(sum(stage_times)) / k * (chunks + k - 1)


def unit_costs(profile: Profile, stages: int, **options: Any) -> list[tuple[str, float]]:
    """Each unit's name and cost per micro-batch (forward, re-computation, backward; no
    transfer) under the cost model :func:`autopipe.plan` uses with these ``options``."""
    model = build_model(profile, stages, PlanSettings(**options))
    return list(zip(model.layers.names, (float(t) for t in model.layer_time()), strict=True))


def bounding_unit(
    units: Sequence[tuple[str, float]],
    stage_times: Sequence[float],
    devices: int | None = None,
) -> tuple[str, float] | None:
    """The unit that makes the ideal bound unreachable: the heaviest, when it costs more
    than a perfect share ``Σc/n`` of the stage costs ``c`` over the ``n`` devices
    (default: one per stage; no split can cut a unit); ``None`` when every unit fits in
    a share."""
    if not units or not stage_times:
        return None
    share = float(sum(stage_times)) / (len(stage_times) if devices is None else devices)
    name, cost = max(units, key=lambda unit: unit[1])
    return (name, cost) if cost > share else None


@dataclass(frozen=True)
class SplitSummary:
    """One split's measured training step against its prediction and the ideal bound.

    Attributes:
        label: the strategy (or ``given`` for the user's balance).
        balance: units per stage.
        measured: median seconds per step.
        spread: interquartile range of the step times over their median.
        steps: timed steps.
        predicted: the plan's predicted seconds per step.
        ideal: :func:`ideal_step` of the plan's stage costs.
        stage_times: the plan's per-micro-batch stage costs, seconds.
        saved_peak: per stage, the measured peak saved-for-backward bytes (or ``None``).
        predicted_activation: per stage, the plan's predicted activation bytes at its peak.
        bound_unit: the unit heavier than ``Σc/K`` and its cost, when there is one.
        times: every timed step, seconds.
    """

    label: str
    balance: list[int]
    measured: float
    spread: float
    steps: int
    predicted: float
    ideal: float
    stage_times: list[float]
    saved_peak: list[int | None]
    predicted_activation: list[float]
    bound_unit: tuple[str, float] | None
    times: list[float]

    @property
    def over_predicted(self) -> float:
        """Measured over predicted step time."""
        return self.measured / self.predicted if self.predicted > 0 else float("inf")

    @property
    def over_ideal(self) -> float:
        """Measured step time over the ideal balanced bound."""
        return self.measured / self.ideal if self.ideal > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """The summary as JSON-ready values, the ratios included."""
        record = asdict(self)
        record["bound_unit"] = (
            None
            if self.bound_unit is None
            else {"name": self.bound_unit[0], "cost": self.bound_unit[1]}
        )
        record["measured_over_predicted"] = self.over_predicted
        record["measured_over_ideal"] = self.over_ideal
        return record


def summarize(
    label: str, plan: Plan, measured: Measured, units: Sequence[tuple[str, float]] = ()
) -> SplitSummary:
    """The summary of one split's ``measured`` steps against its ``plan``.

    Args:
        label: the split's name.
        plan: the plan it ran (balance, chunks, stage costs, predicted step).
        measured: what the runner measured.
        units: :func:`unit_costs`, to name a unit that bounds the ideal.
    """
    median, spread = median_spread(measured.times)
    stage_times = [stage.time for stage in plan.stages]
    return SplitSummary(
        label=label,
        balance=list(plan.balance),
        measured=median,
        spread=spread,
        steps=len(measured.times),
        predicted=plan.step_time,
        ideal=ideal_step(stage_times, plan.chunks, plan.num_devices),
        stage_times=stage_times,
        saved_peak=list(measured.saved_peak),
        predicted_activation=[stage.activation_memory for stage in plan.stages],
        bound_unit=bounding_unit(units, stage_times, plan.num_devices),
        times=list(measured.times),
    )


def speedups(summaries: Sequence[SplitSummary]) -> dict[str, dict[str, float]]:
    """How much faster each split measured than each other: ``result[a][b]`` is b's
    median step over a's (above 1: a is faster)."""
    return {
        a.label: {b.label: b.measured / a.measured for b in summaries if b.label != a.label}
        for a in summaries
    }


def bench_record(summaries: Sequence[SplitSummary], settings: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a benchmark found, for ``--json``: its settings, every split, the
    speed-ups."""
    return {
        "settings": dict(settings),
        "splits": [summary.to_dict() for summary in summaries],
        "speedups": speedups(summaries),
    }
