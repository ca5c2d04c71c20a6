"""Exhaustive references for the planner, its solvers and the search: every split, every
configuration."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from autopipe import PlanningError, plan
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.spans import split_fits
from autopipe.planning.planner import evaluate
from autopipe.planning.split.interleaved_balance import interleaved_split, pipeline_time
from tests.support.planning_cases import random_profile, splits


def brute_force(profile, devices, **kwargs):
    """The fastest split that fits of every split into ``len(devices)`` stages, or ``None``."""
    best = None
    for balance in splits(len(profile), len(devices)):
        candidate = evaluate(profile, balance, devices, **kwargs)
        fits = all(s.capacity is None or s.memory <= s.capacity for s in candidate.stages)
        if fits and (best is None or candidate.step_time < best.step_time):
            best = candidate
    return best


def check_against_brute_force(profile, devices, **kwargs):
    """``plan`` finds the brute-force best step time, or fails exactly when nothing fits."""
    expected = brute_force(profile, devices, **kwargs)
    if expected is None:
        with pytest.raises(PlanningError):
            plan(profile, devices, **kwargs)
        return
    found = plan(profile, devices, **kwargs)
    assert found.step_time == pytest.approx(expected.step_time, rel=1e-9)
    assert all(s.memory <= s.capacity for s in found.stages if s.capacity is not None)


def exhaustive(profile, devices, *, batch, checkpoints, schedules, **options):
    """Every configuration's plan() that fits, as (step time, K, D, M, mode, schedule)."""
    found = []
    for k in range(1, min(devices, len(profile)) + 1):
        for d in range(1, min(devices // k, batch) + 1):
            replica = math.ceil(batch / d)
            for m, mode, schedule in itertools.product(
                range(1, replica + 1), checkpoints, schedules
            ):
                try:
                    result = plan(
                        profile,
                        k,
                        chunks=m,
                        checkpoint=mode,
                        schedule=schedule,
                        data_parallel=d,
                        batch=batch,
                        **options,
                    )
                except PlanningError:
                    continue
                found.append((result.step_time, k, d, result.chunks, mode, schedule))
    return sorted(found)


def random_model(
    seed: int,
    layers: int = 7,
    stages: int = 3,
    *,
    capacity_share: float | None = None,
    bandwidth: float | None = None,
    speeds: list[float] | None = None,
    chunks: int = 4,
    checkpoint: str = "never",
    schedule: str = "1f1b",
    **options: Any,
) -> CostModel:
    """The cost model of a random profile (integer figures, peaks on even seeds) on
    ``stages`` devices, each with ``capacity_share`` of the memory that one stage holding
    every layer needs without checkpointing (unlimited when ``None``)."""
    profile = random_profile(np.random.default_rng(seed), layers, peaks=seed % 2 == 0)
    costs = ProfileLines.from_profile(profile).at(4)

    def build(capacity: int | None, mode: str, **more: Any) -> CostModel:
        devices = [
            DeviceSpec("cpu", capacity, speed=speed, bandwidth=bandwidth)
            for speed in speeds or [1.0] * stages
        ]
        return CostModel(costs, devices, chunks, mode, schedule, 2.0, CostOptions(**more))

    capacity = None
    if capacity_share is not None:
        whole = build(None, "never")
        need = float(whole.stage_memory(0, np.array(0), np.array(layers)))
        capacity = int(capacity_share * need)
    return build(capacity, checkpoint, **options)


def fitting_splits(model: CostModel, extra: float = 0.0) -> list[list[int]]:
    """Every split of the model's layers whose stages all fit their devices (plus ``extra``
    bytes each)."""
    found = []
    for balance in splits(model.num_layers, model.num_stages):
        bounds = np.cumsum([0, *balance])
        if all(
            model.stage_memory(k, np.array(s), np.array(e)) <= model.capacity(k) + extra
            for k, (s, e) in enumerate(itertools.pairwise(bounds))
        ):
            found.append(balance)
    return found


def fitting_rank_splits(model: CostModel) -> list[list[int]]:
    """Every split whose stages fit their devices and whose ranks (a rank's virtual
    stages together) fit theirs: :func:`autopipe.planning.model.spans.split_fits`."""
    return [b for b in splits(model.num_layers, model.num_stages) if split_fits(model, b)]


def check_replayed_split(model: CostModel) -> bool:
    """Checks that the replayed split (:func:`interleaved_split` of every split when few)
    is the fastest of every split that fits, or ``None`` when none fits; whether one fits."""
    fitting = fitting_rank_splits(model)
    found = interleaved_split(model, [])
    if not fitting:
        assert found is None
        return False
    assert found in fitting
    best = min(pipeline_time(model, b) for b in fitting)
    assert pipeline_time(model, found) == pytest.approx(best, rel=1e-12)
    return True
