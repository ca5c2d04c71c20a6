"""What a plan's report says in one cell: each device's memory, the checkpoint mode."""

from __future__ import annotations

from autopipe.output.plan_summary import checkpoint_label, device_memory
from autopipe.planning import plan
from tests.support.planning_cases import linear_profile

PROFILE = linear_profile([1.0, 2, 3, 1, 2, 3, 1, 2], saved=[100] * 8, batch=8, chunks=4)


def test_a_device_holding_two_stages_reports_them_together() -> None:
    made = plan(PROFILE, 4, chunks=4, virtual_stages=2, checkpoint="never")
    memory = device_memory(made)
    assert len(memory) == 2
    assert made.device_memory is not None and memory == made.device_memory
    assert max(memory) > max(stage.memory for stage in made.stages)


def test_one_stage_per_device_reports_each_stage() -> None:
    made = plan(PROFILE, 2, chunks=4, checkpoint="never")
    assert device_memory(made) == [stage.memory for stage in made.stages]


def test_the_label_counts_the_stages_that_checkpoint_and_says_the_norms() -> None:
    made = plan(PROFILE, 2, chunks=4, checkpoint="never")
    assert checkpoint_label(made) == "never"
    made.checkpoint = "auto"
    made.stages[0].checkpoint = "always"
    assert checkpoint_label(made) == "auto (1 of 2 stages checkpoint)"
    made.recompute_norms = True
    assert checkpoint_label(made) == "auto (1 of 2 stages checkpoint) + norms re-computed"
