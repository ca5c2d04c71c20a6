"""``search(..., one_device=True)`` (autopipe.planning.configuration.one_device_search):
stages taking turns on one device, against the plans ``plan(..., colocated=True)`` makes."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe import PlanningError, plan
from autopipe.planning.configuration.config_search import search
from autopipe.planning.model.names import SEARCH_CHECKPOINTS
from autopipe.planning.model.plans import Plan
from tests.support.planning_cases import random_profile


def _held(found: Plan) -> float:
    return sum(stage.memory for stage in found.stages)


@pytest.mark.parametrize("seed", range(3))
def test_every_configuration_is_the_colocated_plan(seed: int) -> None:
    profile = random_profile(np.random.default_rng(seed), 6)
    ranked = search(profile, 3, one_device=True, top=1000, batch=8)
    assert ranked and all(p.data_parallel == 1 and p.schedule == "gpipe" for p in ranked)
    assert {p.num_stages for p in ranked} == {1, 2, 3}
    for found in ranked:
        same = plan(
            profile,
            [profile.device] * found.num_stages,
            colocated=True,
            chunks=found.chunks,
            checkpoint=found.checkpoint,
            batch=8,
        )
        assert found.balance == same.balance and found.step_time == same.step_time
        if found.num_stages > 1:
            assert found.shared == [list(range(found.num_stages))]
        # Integer-valued figures: M · Σ c is exact.
        assert found.pipeline_time == found.chunks * sum(s.time for s in found.stages)
    times = [p.step_time for p in ranked]
    assert times == sorted(times)
    # Every configuration the search weighs, planned one by one: none is faster.
    best = min(
        plan(
            profile, [profile.device] * k, colocated=True, chunks=m, checkpoint=c, batch=8
        ).step_time
        for k in (1, 2, 3)
        for m in (1, 2, 3, 4, 8)
        for c in SEARCH_CHECKPOINTS
    )
    assert ranked[0].step_time == best
    assert "taking turns on one" in ranked[0].notes[0]


def test_the_stages_together_must_fit_the_device() -> None:
    profile = random_profile(np.random.default_rng(1), 6)
    free = search(profile, 3, one_device=True, top=1000, batch=8)
    # A capacity every single stage fits but not every configuration's stages together.
    capacity = int(np.median([_held(p) for p in free]))
    assert any(max(s.memory for s in p.stages) <= capacity < _held(p) for p in free)
    fitting = search(profile, 3, one_device=True, top=1000, batch=8, memory=capacity)
    assert fitting and all(_held(p) <= capacity for p in fitting)
    assert len(fitting) < len(free)
    with pytest.raises(PlanningError, match="no configuration of up to 3 stages on one device"):
        search(profile, 3, one_device=True, batch=8, memory="8B")


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"schedules": ["1f1b"]}, "search the schedule gpipe"),
        ({"virtual_stages": (1, 2)}, "run no interleaved virtual stages"),
        ({"shard_optimizer": True}, "no copies to shard the optimizer state over"),
    ],
)
def test_dimensions_one_device_does_not_have_are_refused(
    options: dict[str, object], expected: str
) -> None:
    profile = random_profile(np.random.default_rng(0), 4)
    with pytest.raises(ValueError, match=expected):
        search(profile, 2, one_device=True, **options)


def test_one_device_refuses_the_v_schedules() -> None:
    from autopipe.planning.configuration.one_device_search import check_one_device

    with pytest.raises(ValueError, match="not zbv or dualpipev"):
        check_one_device(["gpipe", "zbv"], [1], False)
