"""Cuts no split may make: every solver's split is the best of the allowed ones, exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autopipe import DeviceSpec, PlanningError, plan
from autopipe.planning.configuration.config_search import search
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.cut_rules import (
    crossing,
    cuts_allowed,
    forbidden_cuts,
    keep_together,
    most_stages,
)
from autopipe.planning.model.plan_settings import PlanSettings, build_model
from autopipe.planning.model.spans import split_fits, stage_memory
from autopipe.planning.planner import evaluate, interleaved_balance
from autopipe.planning.split.exact import memory_split, optimal_split, solve_split, split_value
from autopipe.planning.split.interleaved_balance import pipeline_time
from autopipe.planning.split.intervals import IntervalSolver
from autopipe.planning.split.screening import Relaxation
from profiler.profile import Profile, TiedState
from tests.support.planning_cases import linear_profile, random_profile, splits
from tests.support.planning_references import exhaustive


def _with_unsplit(profile: Profile, spans: list[tuple[int, int]]) -> Profile:
    """The profile with a written buffer (of no bytes: memory as it was) used by the first
    and the last layer of each span, its users kept on one stage."""
    tied = [
        TiedState(names=[f"count{i}"], layers=[a, b], bytes=0, buffer=True, unsplit=True)
        for i, (a, b) in enumerate(spans)
    ]
    return dataclasses.replace(profile, tied=[*profile.tied, *tied])


def _random_spans(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    spans = []
    for _ in range(int(rng.integers(1, 3))):
        a = int(rng.integers(0, n - 1))
        spans.append((a, int(rng.integers(a + 1, min(a + 3, n - 1) + 1))))
    return spans


def test_forbidden_positions_lie_between_the_first_and_the_last_user() -> None:
    tied = [
        TiedState(names=["a"], layers=[1, 3], bytes=0, unsplit=True),
        TiedState(names=["b"], layers=[0, 5], bytes=0),  # may be split: it is copied
    ]
    mask = forbidden_cuts(tied, 6, extra=[5])
    assert np.flatnonzero(mask).tolist() == [2, 3, 5]
    assert most_stages(mask) == 3  # cuts at 1 and 4 only
    assert cuts_allowed([1, 3, 2], mask) and not cuts_allowed([2, 4], mask)
    assert crossing([1, 3, 2], tied) is None and crossing([3, 3], tied) is tied[0]
    with pytest.raises(ValueError, match="between two of the 6 layers"):
        forbidden_cuts(tied, 6, extra=[6])


@pytest.mark.parametrize("seed", range(12))
def test_plan_is_the_best_allowed_split(seed: int) -> None:
    """Against every split: the least step time of those that fit and cut nowhere
    forbidden, for GPipe's formula, 1F1B and replicas (the capped search)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 9))
    profile = _with_unsplit(random_profile(rng, n), _random_spans(rng, n))
    k = int(rng.integers(2, 5))
    memory = [None, 6000][seed % 2]
    devices = [DeviceSpec("d", memory=memory, bandwidth=100.0, latency=0.01)] * k
    options = {
        "chunks": 4,
        "checkpoint": ["never", "auto"][seed % 3 == 0],
        "schedule": ["gpipe", "1f1b"][seed % 2],
        "data_parallel": 1 + seed % 3 // 2,
        "batch": 16,
        "allreduce_bandwidth": 50.0,
    }
    mask = forbidden_cuts(profile.tied, n)
    best = None
    for balance in splits(n, k):
        if not cuts_allowed(balance, mask):
            continue
        found = evaluate(profile, balance, devices, **options)
        if all(s.capacity is None or s.memory <= s.capacity for s in found.stages):
            best = found.step_time if best is None else min(best, found.step_time)
    if best is None:
        with pytest.raises(PlanningError):
            plan(profile, devices, **options)
        return
    result = plan(profile, devices, **options)
    assert cuts_allowed(result.balance, mask)
    assert result.step_time == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(12))
def test_every_solver_honours_the_forbidden_cuts(seed: int) -> None:
    """The exact program, the interval solver, the relaxation's bound, the memory split of
    one shared device and the interleaved split, each against every split."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(5, 9))
    profile = random_profile(rng, n)
    k = int(rng.integers(2, 4))
    forbidden = sorted({int(p) for p in rng.integers(1, n, int(rng.integers(1, n - k + 1)))})
    settings = PlanSettings(chunks=4, memory=[None, 9000][seed % 2], checkpoint="never")
    base = build_model(profile, k, settings)
    model = CostModel(
        base.layers,
        base.devices,
        base.chunks,
        base.checkpoint,
        base.schedule,
        options=CostOptions(forbidden=forbidden),
    )
    allowed = [b for b in splits(n, k) if split_fits(model, b)]
    assert all(cuts_allowed(b, model.forbidden) for b in allowed)
    if not allowed:
        assert solve_split(model) is None
        with pytest.raises(PlanningError):
            optimal_split(model)
        return
    best = min(split_value(model, b) for b in allowed)
    assert split_value(model, optimal_split(model)) == pytest.approx(best, rel=1e-9)
    relaxation = Relaxation(model)
    bound = relaxation.lower_bound()
    assert bound is not None and bound[0] <= best * (1 + 1e-9)
    if relaxation.monotone:
        found = IntervalSolver(relaxation).solve()
        assert found is not None and cuts_allowed(found[1], model.forbidden)
        assert found[0] == pytest.approx(best, rel=1e-9)
    peak = min(float(stage_memory(model, b).max()) for b in allowed)
    assert float(stage_memory(model, memory_split(model)).max()) == peak
    # Two virtual stages per rank: every split replayed (few enough for the exhaustive pass).
    if k == 2 and n >= 4:
        virtual = CostModel(
            base.layers,
            [*base.devices, *base.devices],
            4,
            "never",
            "1f1b",
            options=CostOptions(virtual_stages=2, forbidden=forbidden),
        )
        options = [b for b in splits(n, 4) if split_fits(virtual, b)]
        if options:
            chosen = interleaved_balance(virtual)
            assert cuts_allowed(chosen, virtual.forbidden)
            fastest = min(pipeline_time(virtual, b) for b in options)
            assert pipeline_time(virtual, chosen) == pytest.approx(fastest, rel=1e-12)


def test_no_allowed_split_is_one_error_naming_the_tensor_and_its_users() -> None:
    profile = _with_unsplit(linear_profile([1.0] * 5), [(0, 3)])
    assert plan(profile, 2).balance == [4, 1]
    with pytest.raises(PlanningError) as caught:
        plan(profile, 3)
    message = str(caught.value)
    assert "no split into 3 stages keeps on one stage the users of count0 (used by l0, l3): it" in (
        message
    )
    assert "use at most 2 stages" in message and "\n" not in message


def test_a_peer_split_that_cuts_between_the_users_is_refused() -> None:
    profile = _with_unsplit(linear_profile([1.0] * 4), [(1, 2)])
    with pytest.raises(PlanningError, match=r"the uniform split \[2, 2\] puts the users of count0"):
        plan(profile, 2, strategy="uniform")
    assert plan(profile, 3).balance == [1, 2, 1]  # the one split cutting at 1 and 3


def test_search_finds_the_best_allowed_configuration() -> None:
    rng = np.random.default_rng(7)
    profile = _with_unsplit(random_profile(rng, 6), [(1, 3)])
    checkpoints, schedules = ("never", "except_last"), ("gpipe", "1f1b")
    kwargs = {"batch": 8, "checkpoints": checkpoints, "schedules": schedules}
    expected = exhaustive(profile, 4, **kwargs)
    found = search(profile, 4, top=3, **kwargs)
    assert found[0].step_time == pytest.approx(expected[0][0], rel=1e-9)
    assert all(cuts_allowed(p.balance, forbidden_cuts(profile.tied, 6)) for p in found)


def test_keep_together_marks_by_any_name_and_leaves_the_profile() -> None:
    tied = TiedState(names=["head.weight", "embed.weight"], layers=[0, 2], bytes=0)
    profile = dataclasses.replace(linear_profile([1.0] * 3), tied=[tied])
    assert keep_together(profile, ["other"]) is profile
    marked = keep_together(profile, ["embed.weight"])
    assert marked.tied[0].unsplit and not profile.tied[0].unsplit
    assert "unsplit" not in profile.to_dict()["tied"][0]  # saved as before
    again = Profile.from_dict(marked.to_dict())
    assert again.tied[0].unsplit
    with pytest.raises(PlanningError, match="head.weight"):
        plan(again, 2)
