"""Stage spans of a balance, prefix sums, and the one memory check of a split."""

from __future__ import annotations

import numpy as np

from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.spans import (
    fits_memory,
    overflows,
    prefix_sums,
    split_fits,
    stage_bounds,
    stage_memory,
    stage_spans,
)
from tests.support.planning_cases import random_profile


def test_bounds_and_spans_of_a_balance():
    assert stage_bounds([2, 1, 3]).tolist() == [0, 2, 3, 6]
    spans = stage_spans([2, 1, 3])
    assert spans == [(0, 2), (2, 3), (3, 6)]
    assert all(type(s) is int and type(e) is int for s, e in spans)


def test_prefix_sums_price_any_range():
    values = np.array([1.0, 2.0, 4.0, 8.0])
    prefix = prefix_sums(values)
    assert prefix.tolist() == [0.0, 1.0, 3.0, 7.0, 15.0]
    assert prefix[3] - prefix[1] == values[1:3].sum()
    assert prefix_sums([]).tolist() == [0.0]


def _model(capacity, stages, virtual=1):
    profile = random_profile(np.random.default_rng(3), 8)
    costs = ProfileLines.from_profile(profile).at(2)
    devices = [DeviceSpec("cpu", capacity)] * stages
    return CostModel(costs, devices, 4, "never", "gpipe", 2.0, CostOptions(virtual_stages=virtual))


def test_a_split_fits_when_every_stage_does():
    loose = _model(None, 2)
    assert split_fits(loose, [4, 4])
    memory = stage_memory(loose, [4, 4])
    tight = _model(int(memory.min()), 2)
    stage_over, rank_over = overflows(tight, memory[None, :])
    assert rank_over.shape == (1, 0)  # one stage per device: no rank of its own
    assert stage_over[0].tolist() == (memory - memory.min()).tolist()
    assert split_fits(tight, [4, 4]) == (memory.max() <= memory.min())


def test_a_rank_holds_its_virtual_stages_together():
    loose = _model(None, 4, virtual=2)
    memory = stage_memory(loose, [2, 2, 2, 2])
    held = [memory[0] + memory[2], memory[1] + memory[3]]
    # Room for every stage alone, not for each rank's two together.
    model = _model(int(min(held)) - 1, 4, virtual=2)
    assert np.all(memory <= model.capacity(0))
    stage_over, rank_over = overflows(model, memory[None, :])
    assert np.all(stage_over <= 0)
    assert rank_over[0].tolist() == [h - model.capacity(0) for h in held]
    assert not fits_memory(model, memory[None, :])[0]
    assert not split_fits(model, [2, 2, 2, 2])
