"""The figures both mesh exports share: ZeRO stage, world size, batches, recompute notes."""

from __future__ import annotations

import dataclasses

from autopipe.planning.model.mesh import Mesh
from autopipe.planning.runtimes.mesh_figures import mesh_figures, world_line, zero_stage
from tests.support.mesh_plans import MeshCase, mesh_plan


def test_a_plan_sharding_only_its_optimizer_state_is_zero_1() -> None:
    plan = mesh_plan(MeshCase(replicas=2))
    assert zero_stage(plan) == 0
    assert zero_stage(dataclasses.replace(plan, shard_optimizer=True)) == 1
    assert zero_stage(mesh_plan(MeshCase(mesh=Mesh(zero=3), replicas=2))) == 3


def test_the_world_is_every_degree_multiplied() -> None:
    plan = mesh_plan(MeshCase(mesh=Mesh(tensor=4, context=2), replicas=3))
    figures = mesh_figures(plan, "X")
    assert figures.world == 4 * 2 * 4 * 3 == plan.num_devices
    assert world_line(figures) == "world size 96 = tensor 4 x context 2 x pipeline 4 x data 3"
    assert (figures.micro_batch, figures.chunks, figures.global_batch) == (2, 4, 24)


def test_stages_taking_turns_on_a_device_get_one_each_and_it_is_said() -> None:
    plan = dataclasses.replace(mesh_plan(MeshCase()), shared=[[1, 2]])
    figures = mesh_figures(plan, "X")
    assert (plan.num_devices, figures.world) == (3, 4)
    assert any("(3 devices); X gives every rank's stages" in note for note in figures.notes)


def test_a_batch_the_replicas_cannot_split_evenly_rounds_up_and_it_is_said() -> None:
    plan = dataclasses.replace(mesh_plan(MeshCase(replicas=2)), batch_size=15)
    figures = mesh_figures(plan, "X")
    assert figures.global_batch == 16
    assert "the plan's batch of 15 samples rounds up to 16" in " ".join(figures.notes)


def test_recompute_is_one_mode_for_all_layers() -> None:
    assert not mesh_figures(mesh_plan(MeshCase(checkpoint="never")), "X").recompute
    figures = mesh_figures(mesh_plan(MeshCase(checkpoint="except_last")), "X")
    assert figures.recompute and any("except_last" in note for note in figures.notes)


def test_without_the_layers_units_stages_recompute_everything_and_it_is_said() -> None:
    plan = mesh_plan(MeshCase(checkpoint=("never", "never", "never", "never")))
    stages = [
        plan.stages[0],
        dataclasses.replace(plan.stages[1], checkpoint="units", recompute_units=[3]),
        *plan.stages[2:],
    ]
    figures = mesh_figures(dataclasses.replace(plan, stages=stages, checkpoint="auto"), "X")
    assert figures.recompute and figures.recompute_layers is None
    assert "stages [1] re-compute some of their units; X applies one mode" in " ".join(
        figures.notes
    )
