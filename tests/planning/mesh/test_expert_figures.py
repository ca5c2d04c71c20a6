"""One device's figures of routed experts under expert parallelism, against hand counts.

The blocks of :func:`tests.support.mesh_profiles.moe_profile` at one sample: forward 8 s
of 64 FLOPs, 32 of them the routed experts' (4 experts, one block), backward 16 s (64 of
128), 4096 parameter bytes of which 2048 are the experts', 1024 saved bytes (256 the
experts'), 128 bytes of token copies dispatched per forward. Links of 64 bytes/s and
0.5 s per message keep every figure exact in float64.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autopipe.planning.mesh.degree_figures import GroupLinks, MeshLines, mesh_lines
from autopipe.planning.mesh.expert_figures import ExpertTable, remote_nodes
from autopipe.planning.mesh.mesh_links import GroupLink
from autopipe.planning.mesh.shard_table import ShardTable
from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import ProfileLines
from autopipe.planning.model.mesh import Mesh
from profiler import Profile
from tests.support.mesh_profiles import block_profile, moe_profile, roofline_record

LINK = GroupLink(64.0, 0.5)
LINKS = GroupLinks(LINK, LINK, LINK)


def _lines(profile: Profile, mesh: Mesh, replicas: int) -> MeshLines:
    lines = ProfileLines.from_profile(profile)
    return mesh_lines(lines, ShardTable.from_profile(profile), mesh, LINKS, replicas)


def _state(profile: Profile, mesh: Mesh, replicas: int) -> float:
    """A device's parameters, gradients and Adam state of the one-layer stage."""
    costs = _lines(profile, mesh, replicas).at(1)
    options = CostOptions(data_parallel=replicas, mesh=mesh)
    device = DeviceSpec("d0", None, 1.0, None, 0.0)
    model = CostModel(costs, [device], 1, "never", "gpipe", 2.0, options)
    return float(model.state_memory(np.array(0), np.array(1)))


@pytest.mark.parametrize(
    ("expert", "alltoall", "params", "state"),
    [
        # e = 1: nothing sent; 4096 bytes at ZeRO-1 over 4: 2 + 2/4 per byte.
        (1, 0.0, 4096, 4096 * 2.5),
        # e = 2: 2 · 1/2 · 128 B / 64 B/s + 2 · 0.5 s; 2048 + 2048/2 bytes, the experts'
        # ZeRO-1 over 4/2 devices: 2 + 2/2 per byte.
        (2, 3.0, 3072, 2048 * 2.5 + 1024 * 3.0),
        # e = 4: 2 · 3/4 · 128 / 64 + 1; the experts' state whole (over 4/4 devices).
        (4, 4.0, 2560, 2048 * 2.5 + 512 * 4.0),
    ],
)
def test_expert_parallelism_divides_the_experts_and_sends_two_all_to_alls_per_pass(
    expert: int, alltoall: float, params: float, state: float
) -> None:
    mesh = Mesh(zero=1, expert=expert)
    lines = _lines(moe_profile(1), mesh, replicas=4)
    costs = lines.at(1)
    assert costs.forward.tolist() == [8.0 + alltoall]
    assert costs.backward.tolist() == [16.0 + alltoall]
    assert costs.backward_input is not None
    assert costs.backward_input.tolist() == [8.0 + alltoall]
    assert costs.params.tolist() == [params]
    assert costs.experts is not None and costs.experts.tolist() == [2048 / expert]
    assert costs.saved.tolist() == [1024.0]  # a device's tokens, whatever e
    # Two samples: twice the bytes, the same two messages.
    doubled = 2 * (alltoall - 1.0) + 1.0 if alltoall else 0.0
    assert lines.part("ep_forward", 2).tolist() == [doubled]
    assert _state(moe_profile(1), mesh, 4) == state


def test_the_straggler_holds_the_busiest_expert() -> None:
    table = ExpertTable.from_profile(moe_profile(1, top_k=1, skew=2.5))
    assert table is not None
    # σ = 1 + (S − 1)·(e − 1)/(E − 1): balanced at e = 1, S itself at e = E.
    assert [float(table.straggler(e)[0]) for e in (1, 2, 4)] == [1.0, 1.5, 2.5]
    for expert, sigma, alltoall in ((2, 1.5, 3.0), (4, 2.5, 4.0)):
        costs = _lines(moe_profile(1, top_k=1, skew=2.5), Mesh(expert=expert), 4).at(1)
        # 4 s of the dense half, 4 s of the experts' scaled by σ, then the all-to-alls.
        assert costs.forward.tolist() == [4.0 + 4.0 * sigma + alltoall]
        assert costs.backward.tolist() == [8.0 + 8.0 * sigma + alltoall]
        # 768 dense saved bytes and the experts' 256 at the straggler's share.
        assert costs.saved.tolist() == [768.0 + 256.0 * sigma]


def test_the_experts_are_whole_on_each_device_of_a_tensor_parallel_group() -> None:
    # t = 2, e = 2 over D = 2: the dense half sharded (32 FLOPs over 2), the experts not;
    # the all-reduces of the tensor-parallel group: 2 · 1/2 · 256 / 64 + 2 · 0.5 = 5 s.
    costs = _lines(moe_profile(1), Mesh(tensor=2, expert=2), 2).at(1)
    assert costs.forward.tolist() == [8.0 * (16 + 32) / 64 + 5.0 + 3.0]
    assert costs.params.tolist() == [2048 / 2 + 2048 / 2]
    # Sequence parallelism: each device routes half the tokens (2 · 1/2 · 64 / 64 + 1).
    sp = _lines(moe_profile(1), Mesh(tensor=2, sequence_parallel=True, expert=2), 2).at(1)
    assert sp.forward.tolist() == [8.0 * (16 + 16) / 64 + 5.0 + 2.0]
    # The experts' ZeRO-1 over t·D·c/e = 2 devices, as the dense part's over D·c = 2.
    assert _state(moe_profile(1), Mesh(tensor=2, zero=1, expert=2), 2) == 2048 * 3.0


def test_context_parallelism_divides_the_tokens_each_device_routes() -> None:
    costs = _lines(moe_profile(1), Mesh(context=2, expert=2), 1).at(1)
    # 2 · 1/2 · 128/2 B / 64 B/s + 2 · 0.5 s per pass.
    assert (costs.forward - _lines(moe_profile(1), Mesh(context=2), 1).at(1).forward).tolist() == [
        2.0
    ]


def _estimated(expert_weights: int, **kw: float) -> Profile:
    """The one-block profile estimated on a 16 FLOP/s, 4 B/s roofline, its experts'
    parameters ``expert_weights`` bytes."""
    profile = moe_profile(1, estimate=roofline_record(peak=16.0, bandwidth=4.0), **kw)
    experts = profile.layers[0].experts
    assert experts is not None
    experts.param_bytes = expert_weights
    return profile


def test_a_roofline_estimate_prices_the_straggler_s_counts() -> None:
    # The experts' 16 B of forward traffic (their FLOPs' share of 32): 4 B of weights,
    # a device's 1/4 of them at e = 4, and 12 B following the tokens.
    balanced = _lines(_estimated(4), Mesh(expert=4), 4).at(1)
    # max(64 FLOPs / 16, (16 + 12 + 4/4) B / 4) + the all-to-alls' 4 s.
    assert balanced.forward.tolist() == [(16 + 12 + 1) / 4 + 4.0]
    skewed = _lines(_estimated(4, top_k=1, skew=2.5), Mesh(expert=4), 4).at(1)
    # The experts' 32 FLOPs and their tokens' 12 B at σ = 2.5; the weights' 1 B.
    assert skewed.forward.tolist() == [max((32 + 80) / 16, (16 + 30 + 1) / 4) + 4.0]
    # Backward: 32 B, 8 B of it the weights (read, and written as gradients).
    assert balanced.backward.tolist() == [max(128 / 16, (32 + 24 + 2) / 4) + 4.0]


def test_every_device_reads_every_expert_without_expert_parallelism() -> None:
    """The experts' weights (here more than their share of the traffic: all of it is
    theirs) are read whole at e = 1 and a quarter of them at e = 4."""
    whole = _lines(_estimated(2048), Mesh(expert=1), 4).at(1)
    quarter = _lines(_estimated(2048), Mesh(expert=4), 4).at(1)
    assert whole.forward.tolist() == [max(64 / 16, 32 / 4)]
    assert quarter.forward.tolist() == [max(64 / 16, (16 + 16 / 4) / 4) + 4.0]


def test_zero_exchanges_move_the_experts_over_their_own_replicas() -> None:
    lines = _lines(moe_profile(1), Mesh(zero=2, expert=2), 4)
    # 3/4 of the dense 2048 bytes over 4 devices, 1/2 of the experts' 1024 over 2:
    # 2048 bytes at 64 B/s, in a ring of 3 steps and one of 1.
    assert lines.units is not None and lines.units.tolist() == [2048 / 64 + 4 * 0.5]


@pytest.mark.parametrize(
    ("profile", "mesh", "replicas", "message"),
    [
        (moe_profile(1), Mesh(expert=3), 4, r"must divide the data-parallel .*4 x 1 = 4"),
        (moe_profile(1), Mesh(expert=8), 8, r"every block's routed experts \(4\)"),
        (block_profile(1), Mesh(expert=2), 2, "needs a profile whose layers have routed"),
    ],
)
def test_a_degree_the_rule_refuses_is_one_line(
    profile: Profile, mesh: Mesh, replicas: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _lines(profile, mesh, replicas)


def test_dense_profiles_have_no_expert_table_and_degrees_divide_both_counts() -> None:
    assert ExpertTable.from_profile(block_profile(2)) is None
    table = ExpertTable.from_profile(moe_profile(2, experts=8))
    assert table is not None and table.degrees(12) == [1, 2, 4]
    assert table.degrees(16) == [1, 2, 4, 8]


@pytest.mark.parametrize(
    ("groups", "top_groups", "nodes"), [(8, 4, 8), (8, 4, 2), (4, 2, 2), (6, 1, 3)]
)
def test_remote_nodes_average_every_choice_of_groups(
    groups: int, top_groups: int, nodes: int
) -> None:
    """Every choice of ``top_groups`` groups equally likely, node ``j`` holding groups
    ``j·G/n`` to ``(j+1)·G/n − 1``, a token on node 0: the other nodes it reaches."""
    per_node = groups // nodes
    choices = list(itertools.combinations(range(groups), top_groups))
    reached = [len({g // per_node for g in chosen} - {0}) for chosen in choices]
    got = remote_nodes(np.array([groups]), np.array([top_groups]), nodes)
    assert got.tolist() == pytest.approx([sum(reached) / len(choices)], rel=1e-12)


INTRA = GroupLink(128.0, 0.25)


def _node_limited(nodes: int, groups: int = 4, top_groups: int = 2, expert: int = 4) -> float:
    """The all-to-alls' seconds of a forward of the 8-expert block over ``nodes`` nodes."""
    profile = moe_profile(1, experts=8, groups=groups, top_groups=top_groups)
    links = GroupLinks(LINK, LINK, LINK, LINK, nodes, INTRA)
    lines = ProfileLines.from_profile(profile)
    table = ShardTable.from_profile(profile)
    found = mesh_lines(lines, table, Mesh(expert=expert), links, 4)
    return float(found.part("ep_forward", 1)[0])


def test_node_limited_routing_crosses_to_each_other_node_once() -> None:
    """e = 4 over 2 nodes, 2 of 4 groups: a token reaches the other node with chance
    1 − C(2, 2)/C(4, 2) = 5/6, one row of 128/2 B each way; inside the node, half of its
    2 copies move on (2 · 1/2 · 128 B over 128 B/s). The longer leg counts."""
    crossing = 2 * (5 / 6) * 64 / 64 + 2 * 0.5
    inside = 2 * 0.5 * 128 / 128 + 2 * 0.25
    assert _node_limited(2) == pytest.approx(max(crossing, inside), rel=1e-12)
    # Flat all-to-all of every copy (2 · 3/4 · 128 B over 64 B/s, 2 messages) where the
    # routing is not node-limited: one node, groups not whole on each node, no group limit.
    flat = 2 * 0.75 * 128 / 64 + 2 * 0.5
    assert _node_limited(1) == flat
    assert _node_limited(2, groups=1, top_groups=1) == flat
    assert _node_limited(2, groups=8, top_groups=8) == flat
    assert _node_limited(4, groups=2, top_groups=1) == flat


def test_the_experts_counted_traffic_replaces_their_flops_share() -> None:
    """Counted: 10 B of the layer's 32 forward, 8 of them the weights (a device's 1/4 at
    e = 4): 32 − 10 + 2 + 8/4 = 26 B at 4 B/s; backward 64 − 20 + 4 + 16/4 = 52 B."""
    profile = _estimated(2048)
    experts = profile.layers[0].experts
    assert experts is not None
    experts.traffic, experts.weight_traffic = [10.0, 20.0], [8.0, 8.0]
    experts.backward_traffic, experts.backward_weight_traffic = [20.0, 40.0], [16.0, 16.0]
    costs = _lines(profile, Mesh(expert=4), 4).at(1)
    assert costs.forward.tolist() == [26 / 4 + 4.0]
    assert costs.backward.tolist() == [52 / 4 + 4.0]
