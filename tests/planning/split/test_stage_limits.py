"""The most layers each stage holds within memory (autopipe.planning.split.stage_limits), against
the cost model's memory of every stage."""

from __future__ import annotations

import numpy as np
import pytest

from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.split.stage_limits import MemoryLimits
from tests.support.planning_cases import linear_profile
from tests.support.planning_references import random_model


def _brute_ends(model: CostModel, k: int, extra: float = 0.0) -> list[int]:
    """Per start s: the largest end e whose stage [s, e) fits, s when none does."""
    cap = model.capacity(k) + extra
    ends = []
    for s in range(model.num_layers):
        fitting = [
            e
            for e in range(s + 1, model.num_layers + 1)
            if model.stage_memory(k, np.array(s), np.array(e)) <= cap
        ]
        ends.append(max(fitting, default=s))
    return ends


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("share", [0.05, 0.3, 0.6, 2.0])
def test_ends_are_the_largest_fitting_stage_of_each_start(checkpoint: str, share: float) -> None:
    for seed in range(6):
        model = random_model(seed, capacity_share=share, checkpoint=checkpoint)
        limits = MemoryLimits(model)
        for k in range(model.num_stages):
            expected = _brute_ends(model, k)
            assert limits.lists[k][0] == expected
            assert limits.ends[k][0].tolist() == expected
            assert limits.envelopes[k][0] == np.maximum.accumulate(expected).tolist()


def test_auto_has_the_limits_of_each_mode_it_chooses_from() -> None:
    for seed in range(4):
        auto = random_model(seed, capacity_share=0.3, checkpoint="auto")
        limits = MemoryLimits(auto)
        assert len(auto.modes) == 2
        for i, mode in enumerate(auto.modes):
            fixed = MemoryLimits(random_model(seed, capacity_share=0.3, checkpoint=mode))
            assert [limits.lists[k][i] for k in range(3)] == [fixed.lists[k][0] for k in range(3)]


def test_extra_bytes_raise_every_capacity() -> None:
    model = random_model(1, capacity_share=0.3)
    extra = 0.2 * model.capacity(0)
    raised = MemoryLimits(model, extra=extra)
    assert [raised.lists[k][0] for k in range(3)] == [
        _brute_ends(model, k, extra) for k in range(3)
    ]


def test_without_a_capacity_every_stage_may_run_to_the_last_layer() -> None:
    limits = MemoryLimits(random_model(3))
    assert limits.lists == [[[7] * 7]] * 3
    assert limits.monotone


def test_a_layer_that_fits_nowhere_ends_at_its_start() -> None:
    # Each layer holds 100 parameter bytes: 400 with its gradient and two Adam states.
    costs = ProfileLines.from_profile(linear_profile([1.0] * 4, params=[100] * 4)).at(8)
    model = CostModel(costs, [DeviceSpec("cpu", 800)] * 2, 1, "never", "gpipe", 2.0)
    assert MemoryLimits(model).lists[0][0] == [2, 3, 4, 4]
    model = CostModel(costs, [DeviceSpec("cpu", 300)] * 2, 1, "never", "gpipe", 2.0)
    assert MemoryLimits(model).lists[0][0] == [0, 1, 2, 3]


def test_monotone_says_whether_the_ends_never_fall() -> None:
    seen = set()
    for seed in range(8):
        for share in (0.1, 0.3):
            limits = MemoryLimits(random_model(seed, capacity_share=share, checkpoint="always"))
            rising = all(
                limits.lists[k][i] == limits.envelopes[k][i]
                for k in range(3)
                for i in range(len(limits.lists[k]))
            )
            assert limits.monotone == rising
            seen.add(rising)
    assert seen == {True, False}  # both kinds of limits were met


def test_stages_of_one_signature_share_the_cache() -> None:
    model = random_model(0, capacity_share=0.3)
    cache: dict[tuple[object, ...], object] = {}
    MemoryLimits(model, cache)  # type: ignore[arg-type]
    # One device and one mode: stages differ only in the micro-batches they hold in flight.
    assert len(cache) == len({model.in_flight(k) for k in range(3)})
