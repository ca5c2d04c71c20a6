"""Which link each group of a mesh runs its collectives on.

The mesh's dimensions (:data:`autopipe.planning.model.mesh.MESH_DIMENSIONS`, outermost
first) take ranks so that the innermost is contiguous: a group of dimension ``X`` spans
the product of the sizes of ``X`` and of every dimension inside it. A group whose span
fits one node of ``per_node`` devices runs on the intra-node link, any other on the
inter-node one (a ring is as slow as the slowest link it crosses).

Expert parallelism (``ep``) has no dimension of its own: as torchtitan borrows it from
``dp_shard`` and ``cp``, an expert-parallel group of ``e`` takes ``e`` ranks of the
context-parallel group first and then, when ``e > c``, ``⌈e/c⌉`` ranks of the data
dimension (``dp_shard`` under ZeRO, else ``dp_replicate``): it spans the larger of the
two extents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.model.mesh import Mesh

__all__ = ["GroupLink", "MeshLinks"]


@dataclass(frozen=True)
class GroupLink:
    """A link a group's collectives run on: bytes/s per device (``None``: free) and
    seconds per message."""

    bandwidth: float | None
    latency: float = 0.0

    def seconds(
        self, volume: NDArray[np.float64], messages: NDArray[np.float64]
    ) -> NDArray[np.float64]:
        """Seconds to move ``volume`` bytes per device in ``messages`` messages."""
        moved = volume / self.bandwidth if self.bandwidth else np.zeros_like(volume)
        return np.asarray(moved + messages * self.latency)


@dataclass(frozen=True)
class MeshLinks:
    """The intra- and inter-node links of a kind of device.

    Attributes:
        intra: the link between two devices of one node.
        inter: the link between nodes.
        per_node: devices per node (0: every device on one node).
    """

    intra: GroupLink
    inter: GroupLink
    per_node: int = 0

    @classmethod
    def uniform(cls, link: GroupLink) -> MeshLinks:
        """One link for every group (what a profile's calibration knows)."""
        return cls(link, link, 0)


def dimension_sizes(mesh: Mesh, stages: int, replicas: int) -> dict[str, int]:
    """The size of each mesh dimension: ``stages`` ranks per pipeline, ``replicas`` on
    ``dp_shard`` when ZeRO shards over them (FSDP's dimension), else on ``dp_replicate``."""
    shard = mesh.zero >= 1
    return {
        "pp": stages,
        "dp_replicate": 1 if shard else replicas,
        "dp_shard": replicas if shard else 1,
        "cp": mesh.context,
        "tp": mesh.tensor,
    }


def span(mesh: Mesh, stages: int, replicas: int, dimension: str) -> int:
    """Ranks a group of ``dimension`` spans: its size times those of the dimensions inside."""
    sizes = dimension_sizes(mesh, stages, replicas)
    inner = mesh.order[mesh.order.index(dimension) :]
    total = 1
    for name in inner:
        total *= sizes[name]
    return total


def expert_span(mesh: Mesh, stages: int, replicas: int) -> int:
    """Ranks an expert-parallel group spans (see the module docstring)."""
    e, c = mesh.expert, mesh.context
    sizes = dimension_sizes(mesh, stages, replicas)
    context = span(mesh, stages, replicas, "cp") // c * min(e, c)
    if e <= c:
        return context
    data = "dp_shard" if mesh.zero >= 1 else "dp_replicate"
    stride = span(mesh, stages, replicas, data) // sizes[data]
    return max(context, -(-e // c) * stride)


def expert_nodes(links: MeshLinks, mesh: Mesh, stages: int, replicas: int) -> int:
    """Nodes an expert-parallel group's ``e`` ranks lie on (1 when ``per_node`` is 0).

    Its members, as :func:`expert_span` takes them: ``min(e, c)`` ranks of the
    context-parallel group, then as many more such runs along the data dimension.
    """
    e, c = mesh.expert, mesh.context
    if links.per_node == 0 or e == 1:
        return 1
    sizes = dimension_sizes(mesh, stages, replicas)
    step = span(mesh, stages, replicas, "cp") // c
    data = "dp_shard" if mesh.zero >= 1 else "dp_replicate"
    stride = span(mesh, stages, replicas, data) // sizes[data]
    ranks = {(i % c) * step + (i // c) * stride for i in range(e)}
    return len({rank // links.per_node for rank in ranks})


def group_link(
    links: MeshLinks, mesh: Mesh, stages: int, replicas: int, dimension: str
) -> GroupLink:
    """The link of ``dimension``'s groups (``dp``: the data-parallel ring over both
    ``dp_replicate`` and ``dp_shard``, and ``cp`` inside it, as ZeRO shards over both;
    ``ep``: the expert-parallel group, :func:`expert_span`)."""
    if dimension == "ep":
        ranks = expert_span(mesh, stages, replicas)
    elif dimension == "dp":
        ranks = max(
            span(mesh, stages, replicas, "dp_replicate"), span(mesh, stages, replicas, "dp_shard")
        )
        ranks = max(ranks, span(mesh, stages, replicas, "cp"))
    else:
        ranks = span(mesh, stages, replicas, dimension)
    if links.per_node == 0 or ranks <= links.per_node:
        return links.intra
    return links.inter
