"""ZeRO-2/3's exchanges per unit: exposed beyond the neighbouring compute, in the cost
model's memory and step, and on the replayed schedule."""

from __future__ import annotations

import numpy as np

from autopipe.planning.mesh.degree_figures import GroupLinks, mesh_lines
from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.mesh.zero_exchange import unit_exchange, zero_exposed
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.split.interleaved_balance import pipeline_time
from tests.support.mesh_profiles import block_profile

LINK = GroupLink(64.0, 0.5)


def test_a_unit_moves_its_share_of_the_others_parameters() -> None:
    params = np.array([4096.0, 0.0])
    assert unit_exchange(params, 4, LINK).tolist() == [3 / 4 * 4096 / 64 + 0.5, 0.0]
    assert unit_exchange(params, 1, LINK).tolist() == [0.0, 0.0]


def test_compute_long_enough_hides_every_exchange_but_the_ends() -> None:
    params = np.full(3, 4096.0)
    slow = np.full((3, 1), 1000.0)
    forward, backward = zero_exposed(3, params, 2, LINK, slow, slow)
    assert forward[:, 0].tolist() == [32.5, 0.0, 0.0]
    assert backward[:, 0].tolist() == [32.5, 0.0, 32.5]
    forward, backward = zero_exposed(2, params, 2, LINK, slow, slow)
    assert forward[:, 0].tolist() == [0.0] * 3 and backward[:, 0].tolist() == [32.5, 0.0, 0.0]
    assert not zero_exposed(1, params, 2, LINK, slow, slow)[1].any()


def _model(zero: int, replicas: int = 2, chunks: int = 4) -> CostModel:
    profile = block_profile(4)
    lines = ProfileLines.from_profile(profile)
    mesh = Mesh(zero=zero)
    links = GroupLinks(LINK, LINK, LINK)
    costs = mesh_lines(lines, ShardTable.from_profile(profile), mesh, links, replicas).at(1)
    devices = [DeviceSpec(f"d{k}", None, 1.0) for k in range(2)]
    options = CostOptions(data_parallel=replicas, allreduce_bandwidth=64.0, mesh=mesh)
    return CostModel(costs, devices, chunks, "never", "gpipe", 2.0, options)


def test_each_stage_holds_its_share_of_the_state() -> None:
    s, e = np.array(0), np.array(2)
    # Adam (2 state bytes per parameter byte) over S = 2: 4, 3, 1 + 3/2, 4/2 per byte.
    for zero, factor in ((0, 4.0), (1, 3.0), (2, 2.5), (3, 2.0)):
        assert float(_model(zero).state_memory(s, e)) == factor * 2 * 4096
    # ZeRO-3 holds a gathered unit in flight: its parameters and gradients and the next.
    gathered = float(_model(3).stage_memory(0, s, e)) - float(_model(2).stage_memory(0, s, e))
    assert gathered == (2.0 - 2.5) * 2 * 4096 + 3 * 4096


def test_the_exchange_after_the_drain_shrinks_with_the_stage() -> None:
    s, e = np.array(0), np.array(2)
    # all-reduce 2 · 1/2 · 8192 / 64 = 128 s; ZeRO-2 only gathers (64 s); ZeRO-3 nothing.
    assert [float(_model(z).allreduce_time(s, e)) for z in range(4)] == [128.0, 128.0, 64.0, 0.0]


def test_the_replayed_schedule_counts_the_exposed_exchanges() -> None:
    model = _model(3)
    # Stage 0: forwards 8 + 24.5 + 32.5 and 8 + 24.5, backwards 16 + 49 twice; stage 1:
    # forwards 8 + 24.5 and 8, backwards 65 twice. GPipe, M = 4, unbalanced stages:
    # Σc + (M − 1) · max c.
    first, second = 65 + 32.5 + 130, 32.5 + 8 + 130
    assert pipeline_time(model, [2, 2]) == first + second + 3 * first
