"""Which link a mesh group runs on: its span of consecutive ranks against a node."""

from __future__ import annotations

import numpy as np

from autopipe.planning.mesh.mesh_links import (
    GroupLink,
    MeshLinks,
    expert_nodes,
    expert_span,
    group_link,
    span,
)
from autopipe.planning.model.mesh import Mesh

NVLINK, NETWORK = GroupLink(450e9, 1e-6), GroupLink(50e9, 5e-6)
NODE = MeshLinks(NVLINK, NETWORK, per_node=8)


def test_the_innermost_dimension_takes_consecutive_ranks() -> None:
    mesh = Mesh(tensor=8, context=2, per_node=8)
    assert span(mesh, 4, 16, "tp") == 8
    assert span(mesh, 4, 16, "cp") == 16
    assert span(mesh, 4, 16, "dp_replicate") == 16 * 16
    assert span(mesh, 4, 16, "pp") == 4 * 16 * 16


def test_a_group_inside_a_node_uses_the_intra_node_link() -> None:
    mesh = Mesh(tensor=8, per_node=8)
    assert group_link(NODE, mesh, 2, 2, "tp") == NVLINK
    assert group_link(NODE, mesh, 2, 2, "dp") == NETWORK
    small = Mesh(tensor=2, context=2, per_node=8)
    assert group_link(NODE, small, 4, 2, "tp") == NVLINK
    assert group_link(NODE, small, 4, 2, "cp") == NVLINK
    assert group_link(NODE, small, 4, 2, "dp") == NVLINK  # 2 · 2 · 2 = 8 ranks
    assert group_link(NODE, small, 4, 4, "dp") == NETWORK


def test_the_order_decides_which_groups_are_neighbours() -> None:
    # tp outermost: the tensor-parallel group spans every rank, across nodes.
    order = ("tp", "pp", "dp_replicate", "dp_shard", "cp")
    mesh = Mesh(tensor=2, per_node=8, order=order)
    assert group_link(NODE, mesh, 4, 4, "tp") == NETWORK
    assert group_link(NODE, mesh, 4, 2, "dp") == NVLINK


def test_one_node_of_every_device_is_all_intra_node() -> None:
    links = MeshLinks(NVLINK, NETWORK, per_node=0)
    assert group_link(links, Mesh(tensor=8, context=8), 16, 128, "dp") == NVLINK


def test_a_free_link_costs_only_its_latency() -> None:
    free = GroupLink(None, 2.0)
    assert free.seconds(np.array([1e9]), np.array([3.0])).tolist() == [6.0]


def test_an_expert_group_borrows_the_context_ranks_then_the_data_ranks() -> None:
    # t = 2 inside c = 2: e = 2 takes the two context ranks, 2 · 2 apart.
    assert expert_span(Mesh(tensor=2, context=2, expert=2), 2, 4) == 4
    # e = 4 > c: the context group and 2 data replicas (ZeRO-1: dp_shard, stride 4).
    mesh = Mesh(tensor=2, context=2, zero=1, expert=4, per_node=8)
    assert expert_span(mesh, 2, 4) == 8
    assert group_link(NODE, mesh, 2, 4, "ep") == NVLINK
    # e = 8: 4 replicas of 4 ranks each, 16 ranks: across nodes (DeepSeek's EP=64 too).
    wide = Mesh(tensor=2, context=2, zero=1, expert=8, per_node=8)
    assert group_link(NODE, wide, 2, 4, "ep") == NETWORK
    # Without ZeRO the replicas lie on dp_replicate, outside dp_shard: the same stride.
    assert expert_span(Mesh(tensor=2, context=2, expert=4), 2, 4) == 8


def test_an_expert_group_counts_the_nodes_its_ranks_lie_on() -> None:
    # DeepSeek-V3's EP 64 over the 128 ZeRO-1 replicas of a TP 1 stage: 8 whole nodes.
    assert expert_nodes(NODE, Mesh(zero=1, expert=64), 16, 128) == 8
    # TP 2 inside: 8 ranks of the data dimension, every second rank, over 2 nodes.
    assert expert_nodes(NODE, Mesh(tensor=2, expert=8), 4, 16) == 2
    # CP 2 then 2 runs of the data dimension (stride 2): ranks 0, 1, 2, 3: one node.
    assert expert_nodes(NODE, Mesh(context=2, expert=4), 4, 16) == 1
    assert expert_nodes(MeshLinks.uniform(NVLINK), Mesh(expert=64), 16, 128) == 1
