"""The mesh search's configurations, and its ranking against every mesh of 8 devices
evaluated directly (every split of every (t, c, K, D, ZeRO) point)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from autopipe.planning import SearchOptions, search
from autopipe.planning.configuration.mesh_choices import (
    MeshChoices,
    mesh_configurations,
    tensor_degrees,
)
from autopipe.planning.configuration.search_space import (
    Bounds,
    configurations,
    variants,
)
from autopipe.planning.mesh.degree_figures import GroupLinks, mesh_lines
from autopipe.planning.mesh.mesh_links import GroupLink, MeshLinks
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.mesh import Mesh
from autopipe.planning.model.spans import stage_memory
from autopipe.planning.split.exact import split_value
from tests.support.mesh_profiles import block_profile
from tests.support.planning_cases import splits

LINK = GroupLink(64.0, 0.5)
BATCH, DEVICES, CAPACITY = 8, 8, 25_000


def test_every_configuration_takes_every_device_and_m_follows_from_the_batch() -> None:
    choices = MeshChoices((1, 2, 4), (1, 2), (False, True), (0, 1, 2, 3), micro_batch=1)
    configs = mesh_configurations(Bounds(8, 4, 16, ("never",), ("gpipe",)), choices)
    assert configs and all(c.devices == 8 for c in configs)
    assert all(c.chunks * c.replicas * c.micro_batch == 16 for c in configs)
    assert not any(c.sequence_parallel and c.tensor == 1 for c in configs)
    assert not any(c.zero > 0 and c.replicas * c.context == 1 for c in configs)
    assert all(c.stages <= 4 for c in configs)
    # A D whose micro-batches do not divide the batch is left out.
    odd = mesh_configurations(Bounds(8, 8, 6, ("never",), ("gpipe",)), choices)
    assert {c.replicas for c in odd} <= {1, 2}


def test_a_mesh_point_has_the_plain_search_s_variants() -> None:
    # One list of schedules, modes and virtual stages for both searches: a V schedule is
    # one "never" configuration of 2 stages per rank in a mesh search too.
    bounds = Bounds(4, 10, 8, ("never", "always"), ("gpipe", "1f1b", "zbv"), None, (2,))
    mesh = mesh_configurations(bounds, MeshChoices((1, 2)))
    plain = configurations(bounds)
    for configs in (mesh, plain):
        v = [c for c in configs if c.schedule == "zbv"]
        assert v and all((c.virtual, c.checkpoint) == (2, "never") for c in v)
        assert all(c.stages >= 2 for c in v)
        assert any(c.virtual == 2 and c.schedule == "gpipe" for c in configs)
        assert not any(c.schedule == "1f1b" and c.chunks == 1 for c in configs)
    one = [c for c in mesh if (c.tensor, c.stages, c.replicas, c.chunks) == (2, 2, 1, 4)]
    assert one == variants(replace(one[0], checkpoint="never", schedule="gpipe", virtual=1), bounds)


def test_tensor_degrees_default_to_what_the_heads_allow_within_a_node() -> None:
    assert tensor_degrees((), lambda t: 12 % t == 0, 8) == [1, 2, 4]
    assert tensor_degrees((), lambda t: True, 0) == [1, 2, 4, 8]
    assert tensor_degrees((16,), lambda t: True, 8) == [16]


def _brute_force() -> dict[tuple[int, int, int, int, int], tuple[float, float]]:
    """Per mesh point, the best step of the splits that fit and that split's memory."""
    profile = block_profile(4, batch=BATCH)
    lines, table = ProfileLines.from_profile(profile), ShardTable.from_profile(profile)
    links = GroupLinks(LINK, LINK, LINK)
    found = {}
    for t, c, zero in itertools.product((1, 2, 4), (1, 2), (0, 1, 2, 3)):
        for k in (1, 2, 4):
            if DEVICES % (t * c * k):
                continue
            d = DEVICES // (t * c * k)
            if zero and d * c == 1:
                continue
            mesh = Mesh(tensor=t, context=c, zero=zero)
            costs = mesh_lines(lines, table, mesh, links, d).at(1)
            devices = [DeviceSpec(f"d{i}", CAPACITY, 1.0, 64.0, 0.5) for i in range(k)]
            options = CostOptions(data_parallel=d, allreduce_bandwidth=64.0, mesh=mesh)
            model = CostModel(costs, devices, BATCH // d, "never", "gpipe", 2.0, options)
            best = None
            for balance in splits(4, k):
                peak = float(stage_memory(model, balance).max())
                if peak <= CAPACITY:
                    step = split_value(model, balance)
                    if best is None or step < best[0]:
                        best = (step, peak)
            if best is not None:
                found[(t, c, k, d, zero)] = best
    return found


def test_the_search_ranks_every_mesh_as_evaluating_each_directly() -> None:
    expected = _brute_force()
    assert 0 < len(expected) < 50  # of the 50 points, some do not fit
    options = SearchOptions(
        schedules=("gpipe",),
        checkpoints=("never",),
        top=1000,
        tensor_parallel=(1, 2, 4),
        context_parallel=(1, 2),
        zero=(0, 1, 2, 3),
        micro_batch=1,
        links=MeshLinks.uniform(LINK),
    )
    plans = search(
        block_profile(4, batch=BATCH), DEVICES, memory=CAPACITY, optimizer="adam",
        options=options,
    )  # fmt: skip
    got = {}
    for plan in plans:
        m = plan.mesh
        key = (m.tensor, m.context, plan.num_stages, plan.data_parallel, m.zero)
        peak = max(stage.memory for stage in plan.stages)
        assert peak <= CAPACITY and plan.num_devices == DEVICES
        got[key] = (plan.step_time, peak)
    assert set(got) == set(expected)
    for key, (step, _) in expected.items():
        assert got[key][0] == pytest.approx(step, rel=1e-12), key
    assert plans[0].step_time == pytest.approx(min(s for s, _ in expected.values()), rel=1e-12)
