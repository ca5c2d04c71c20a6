"""The mesh search's configurations, and its ranking against every mesh of 8 devices
evaluated directly (every split of every (t, c, K, D, ZeRO) point, and with routed
experts every expert-parallel degree e too)."""

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
from autopipe.planning.schedules.simulation import hidden_alltoalls, makespan, simulate
from autopipe.planning.split.exact import split_value
from profiler import Profile
from tests.support.mesh_profiles import block_profile, moe_profile
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
    # Sharding over one replica shards nothing: asked for ZeRO-1 alone, such meshes are
    # searched as ZeRO-0, once (a deep pipeline over every device is one).
    sharded = mesh_configurations(
        Bounds(8, 8, 16, ("never",), ("gpipe",)), replace(choices, zero=(1, 2))
    )
    lone = [c for c in sharded if c.replicas * c.context == 1]
    assert {c.zero for c in lone} == {0} and any(c.stages == 8 for c in lone)
    assert len(lone) == len({(c.tensor, c.stages, c.sequence_parallel) for c in lone})
    # A D whose micro-batches do not divide the batch is left out.
    odd = mesh_configurations(Bounds(8, 8, 6, ("never",), ("gpipe",)), choices)
    assert {c.replicas for c in odd} <= {1, 2}


def test_a_mesh_point_has_the_plain_search_s_variants() -> None:
    # One list of schedules, modes and virtual stages for both searches: a V schedule
    # gives configurations of 2 stages per rank in a mesh search too, "never" and
    # "always" here (no except_last: its backward splits).
    bounds = Bounds(4, 10, 8, ("never", "always"), ("gpipe", "1f1b", "zbv"), None, (2,))
    mesh = mesh_configurations(bounds, MeshChoices((1, 2)))
    plain = configurations(bounds)
    for configs in (mesh, plain):
        v = [c for c in configs if c.schedule == "zbv"]
        assert v and all(c.virtual == 2 for c in v)
        assert {c.checkpoint for c in v} == {"never", "always"}
        assert all(c.stages >= 2 for c in v)
        assert any(c.virtual == 2 and c.schedule == "gpipe" for c in configs)
        assert not any(c.schedule == "1f1b" and c.chunks == 1 for c in configs)
    one = [c for c in mesh if (c.tensor, c.stages, c.replicas, c.chunks) == (2, 2, 1, 4)]
    assert one == variants(replace(one[0], checkpoint="never", schedule="gpipe", virtual=1), bounds)


def test_tensor_degrees_default_to_what_the_heads_allow_within_a_node() -> None:
    assert tensor_degrees((), lambda t: 12 % t == 0, 8) == [1, 2, 4]
    assert tensor_degrees((), lambda t: True, 0) == [1, 2, 4, 8]
    assert tensor_degrees((16,), lambda t: True, 8) == [16]


def _brute_force(
    profile: Profile | None = None, capacity: int = CAPACITY, experts: tuple[int, ...] = (1,)
) -> dict[tuple[int, ...], tuple[float, float, float]]:
    """Per mesh point ``(t, c, K, D, ZeRO)`` (and ``e`` where ``experts`` lists more than
    1), the best step of the splits that fit, and the least and the most memory of the
    splits that fit at that step."""
    profile = profile or block_profile(4, batch=BATCH)
    lines, table = ProfileLines.from_profile(profile), ShardTable.from_profile(profile)
    links = GroupLinks(LINK, LINK, LINK)
    found = {}
    for t, c, zero, e in itertools.product((1, 2, 4), (1, 2), (0, 1, 2, 3), experts):
        for k in (1, 2, 4):
            if DEVICES % (t * c * k):
                continue
            d = DEVICES // (t * c * k)
            if (zero and d * c == 1) or (d * c) % e:
                continue
            mesh = Mesh(tensor=t, context=c, zero=zero, expert=e)
            costs = mesh_lines(lines, table, mesh, links, d).at(1)
            devices = [DeviceSpec(f"d{i}", capacity, 1.0, 64.0, 0.5) for i in range(k)]
            options = CostOptions(data_parallel=d, allreduce_bandwidth=64.0, mesh=mesh)
            model = CostModel(costs, devices, BATCH // d, "never", "gpipe", 2.0, options)
            best = None
            for balance in splits(4, k):
                peak = float(stage_memory(model, balance).max())
                if peak <= capacity:
                    step = split_value(model, balance)
                    if best is None or step < best[0] * (1 - 1e-12):
                        best = (step, peak, peak)
                    elif step <= best[0] * (1 + 1e-12):  # as fast: its memory may differ
                        best = (best[0], min(best[1], peak), max(best[2], peak))
            if best is not None:
                key = (t, c, k, d, zero, e) if len(experts) > 1 else (t, c, k, d, zero)
                found[key] = best
    return found


# Every mesh of the brute force, each with its one schedule and checkpoint mode.
EVERY_MESH = SearchOptions(
    schedules=("gpipe",),
    checkpoints=("never",),
    top=1000,
    tensor_parallel=(1, 2, 4),
    context_parallel=(1, 2),
    zero=(0, 1, 2, 3),
    micro_batch=1,
    links=MeshLinks.uniform(LINK),
)


def test_the_search_ranks_every_mesh_as_evaluating_each_directly() -> None:
    expected = _brute_force()
    assert 0 < len(expected) < 50  # of the 50 points, some do not fit
    plans = search(
        block_profile(4, batch=BATCH), DEVICES, memory=CAPACITY, optimizer="adam",
        options=EVERY_MESH,
    )  # fmt: skip
    got = {}
    for plan in plans:
        m = plan.mesh
        key = (m.tensor, m.context, plan.num_stages, plan.data_parallel, m.zero)
        peak = max(stage.memory for stage in plan.stages)
        assert peak <= CAPACITY and plan.num_devices == DEVICES
        got[key] = (plan.step_time, peak)
    assert set(got) == set(expected)
    for key, (step, _, _) in expected.items():
        assert got[key][0] == pytest.approx(step, rel=1e-12), key
    assert plans[0].step_time == pytest.approx(min(s for s, _, _ in expected.values()), rel=1e-12)


def test_the_search_weighs_every_expert_degree_as_evaluating_each_directly() -> None:
    """The memory (and step) of every (t, c, K, D, ZeRO, e) point the search returns is
    the best split's of that mesh evaluated directly; e ranges over what the rule allows."""
    profile = moe_profile(4, batch=BATCH)
    capacity = 40_000
    expected = _brute_force(profile, capacity, (1, 2, 4))
    assert any(key[-1] == 4 for key in expected)
    assert any(key not in expected for key in _brute_force(profile, 10**9, (1, 2, 4)))
    plans = search(profile, DEVICES, memory=capacity, optimizer="adam", options=EVERY_MESH)
    got = {}
    for plan in plans:
        m = plan.mesh
        key = (m.tensor, m.context, plan.num_stages, plan.data_parallel, m.zero, m.expert)
        got[key] = (plan.step_time, max(stage.memory for stage in plan.stages))
    assert set(got) == set(expected)
    for key, (step, least, most) in expected.items():
        assert got[key][0] == pytest.approx(step, rel=1e-12), key
        # The plan's memory is that of one of the fastest splits evaluated directly.
        assert least * (1 - 1e-12) <= got[key][1] <= most * (1 + 1e-12), key


def test_dense_profiles_weigh_no_expert_degree() -> None:
    bounds = Bounds(8, 4, 8, ("never",), ("gpipe",))
    dense = mesh_configurations(bounds, MeshChoices((1, 2), (1, 2), micro_batch=1))
    assert dense and all(c.expert == 1 for c in dense)
    moe = mesh_configurations(
        bounds, MeshChoices((1, 2), (1, 2), micro_batch=1, expert=(1, 2, 4, 8), experts=4)
    )
    # The dense configurations, and each again for every e dividing D·c and the 4 experts.
    assert [c for c in moe if c.expert == 1] == dense
    assert {c.expert for c in moe} == {1, 2, 4}
    assert all((c.replicas * c.context) % c.expert == 0 for c in moe)


@pytest.mark.parametrize(("schedules", "zero"), [(("dualpipev",), (0, 1)), (("1f1b",), (3,))])
def test_a_mesh_search_where_nothing_fits_names_the_closest(
    schedules: tuple[str, ...], zero: tuple[int, ...]
) -> None:
    from autopipe import PlanningError

    options = SearchOptions(
        schedules=schedules,
        checkpoints=("never",),
        tensor_parallel=(1, 2),
        zero=zero,
        micro_batch=1,
        links=MeshLinks.uniform(LINK),
    )
    fix = "--zero 2,3" if max(zero) < 3 else "add memory or devices, or use a smaller batch"
    with pytest.raises(PlanningError, match=rf"the closest, .*needs at least .*{fix}"):
        search(block_profile(4, batch=BATCH), DEVICES, memory=1, optimizer="adam", options=options)


def test_dualpipev_with_expert_parallelism_ranks_as_every_replayed_split() -> None:
    """Under dualpipev the overlapped pairs hide part of the all-to-alls: every expert
    degree's plan is the best replayed split of its mesh, and a search keeping one plan
    (pruning on its bounds) finds the best of them all."""
    from autopipe.planning.split.interleaved_balance import pipeline_time

    profile, batch = moe_profile(4, batch=32), 32
    options = SearchOptions(
        schedules=("dualpipev",), checkpoints=("never",), top=1000, micro_batch=1,
        links=MeshLinks.uniform(LINK), expert_parallel=(1, 2, 4),
    )  # fmt: skip
    plans = search(profile, DEVICES, optimizer="adam", options=options)
    assert {p.mesh.expert for p in plans} == {1, 2, 4}
    lines, table = ProfileLines.from_profile(profile), ShardTable.from_profile(profile)
    for plan in plans:
        d, k = plan.data_parallel, plan.num_stages // 2
        mesh = Mesh(expert=plan.mesh.expert)
        costs = mesh_lines(lines, table, mesh, GroupLinks(LINK, LINK, LINK), d).at(1)
        devices = [DeviceSpec("d", None, 1.0, 64.0, 0.5)] * (2 * k)
        opts = CostOptions(data_parallel=d, allreduce_bandwidth=64.0, mesh=mesh)
        model = CostModel(costs, devices, batch // d, "never", "dualpipev", 2.0, opts)
        best = min(
            pipeline_time(model, b) + max(float(model.allreduce_time(s, e)) for s, e in spans(b))
            + model.tied_time(b)
            for b in splits(4, 2 * k)
        )  # fmt: skip
        assert plan.step_time == pytest.approx(best, rel=1e-12)
        # The pairs hide some of the all-to-alls: the report counts what is left.
        hidden = hidden_alltoalls(plan)
        assert (sum(hidden) > 0) == (plan.mesh.expert > 1)
        assert 0 <= plan.bubble < 1
        # The plan's timeline replays the same pairs.
        assert makespan(simulate(plan)) == pytest.approx(plan.pipeline_time, rel=1e-12)
        if plan.mesh.expert > 1:
            assert plan.mesh_parts["expert"] > 0 and plan.stages[0].alltoall_forward > 0
    one = search(profile, DEVICES, optimizer="adam", options=replace(options, top=1))
    assert one[0].step_time == pytest.approx(min(p.step_time for p in plans), rel=1e-12)


def spans(balance: list[int]) -> list[tuple[int, int]]:
    """Each stage's ``(start, stop)`` layers."""
    ends = list(itertools.accumulate(balance))
    return list(zip([0, *ends[:-1]], ends, strict=True))
