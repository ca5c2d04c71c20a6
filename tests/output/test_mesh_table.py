"""The mesh search's table: layout, speed per device, MFU and bottleneck of each plan."""

from __future__ import annotations

from autopipe.output import render_search
from autopipe.output.mesh_table import bottleneck, mesh_label
from autopipe.planning import SearchOptions, format_bytes, search
from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks
from tests.support.mesh_profiles import block_profile, roofline_record

LINKS = MeshLinks(GroupLink(640.0, 0.01), GroupLink(64.0, 0.1), per_node=4)


def _plans() -> list:
    profile = block_profile(8, batch=16, estimate=roofline_record(peak=16.0, bandwidth=4.0))
    options = SearchOptions(
        tensor_parallel=(1, 2, 4),
        context_parallel=(1, 2),
        sequence_parallel=(False, True),
        zero=(0, 1, 2, 3),
        micro_batch=1,
        links=LINKS,
        sequence=4,
        top=4,
    )
    return search(profile, 8, memory=40_000, optimizer="adam", options=options)


def test_every_row_names_its_mesh_and_reports_per_device_figures() -> None:
    plans = _plans()
    text = render_search(plans)
    header = text.splitlines()[0].split()
    assert header[:3] == ["#", "mesh", "M"]
    for column in ("tokens/s/GPU", "TFLOP/s/GPU", "MFU", "bottleneck"):
        assert column in header
    for plan in plans:
        assert mesh_label(plan) in text
        assert plan.num_devices == 8
        # 16 samples of 4 tokens per step over 8 devices.
        assert plan.tokens_per_device == plan.throughput * 4 / 8
        # Counted FLOPs: 8 blocks · (64 + 128) per sample, 16 samples.
        assert plan.model_flops == 8 * 192 * 16
        assert plan.utilization == plan.model_flops / plan.step_time / 8 / 16.0
    assert f"- chosen mesh: {mesh_label(plans[0])}" in text
    assert "- the runner-up (" in text


def test_the_bottleneck_is_the_largest_loss_or_compute() -> None:
    plan = _plans()[0]
    plan.mesh_parts, plan.bubble, plan.allreduce = {"tensor": 0.5 * plan.step_time}, 0.0, 0.0
    assert bottleneck(plan) == "TP comm 50%"
    plan.mesh_parts = {}
    assert bottleneck(plan) == "compute"


def test_the_label_counts_ranks_not_virtual_stages() -> None:
    plan = _plans()[0]
    label = mesh_label(plan)
    assert f"PP={plan.num_stages // plan.virtual_stages}" in label
    assert f"DP={plan.data_parallel}" in label


def test_a_runner_up_that_ties_is_not_said_to_lose() -> None:
    plans = _plans()[:2]
    plans[1].notes.insert(0, "ties with the best; peak memory 2 KiB vs 1 KiB")
    text = render_search(plans)
    assert "ties with the best; peak memory 2 KiB vs 1 KiB" in text
    assert "loses: ties" not in text
    plans[1].notes[0] = "1.20x the best step: bubble 20% vs 10%"
    assert "loses: 1.20x the best step" in render_search(plans)


def test_the_memory_column_is_a_devices_and_the_checkpoint_says_the_norms() -> None:
    """With virtual stages a device holds its stages together: the column is the rank's
    peak, not one stage's; a plan re-computing its norms says so."""
    plan = _plans()[0]
    plan.virtual_stages, plan.device_memory = 2, [123_456_789.0]
    plan.recompute_norms = True
    row = render_search([plan]).splitlines()[1]
    assert format_bytes(123_456_789.0) in row
    assert f"{plan.checkpoint} + norms re-computed" in row
