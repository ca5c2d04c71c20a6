"""The parallel mesh around the pipeline: tensor, context, expert and sharded data
parallelism.

A plan's devices are ``t · c · K · D``: ``K`` pipeline ranks (the plan's stages over its
virtual stages) times ``D`` data-parallel replicas (``Plan.data_parallel``) times, inside
each stage, a tensor-parallel group of ``t`` and a context-parallel group of ``c``. The
mesh's ``order`` (outermost first, torchtitan's names) decides which groups are
neighbours: the innermost dimensions take consecutive ranks, so with ``per_node``
devices per node a group whose ranks fit one node runs on the intra-node link.

Expert parallelism of degree ``e`` takes no devices of its own: its groups are carved
from the ``D·c`` ranks over which a stage's parameters are replicated (Megatron's
expert-model-parallel groups inside the data-parallel and context-parallel ranks), each
device holding ``1/e`` of every mixture-of-experts block's routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MESH_DIMENSIONS", "ZERO_STAGES", "Mesh"]

# torchtitan's device-mesh dimensions, outermost first (its ParallelDims order).
MESH_DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# 0: replicas hold everything; 1: optimizer state sharded (ZeRO-1); 2: and gradients
# (ZeRO-2); 3: and parameters, gathered per unit as they run (ZeRO-3, FSDP).
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Mesh:
    """How a plan's devices are laid out beyond the pipeline's stages.

    Attributes:
        tensor: the tensor-parallel degree ``t`` inside each stage.
        context: the context-parallel degree ``c`` (each sample's sequence split over
            ``c`` devices, attention exchanging keys and values in a ring).
        sequence_parallel: the tensor-parallel group also splits the activations
            between its sharded regions along the sequence (Megatron's
            ``--sequence-parallel``).
        zero: how the ``D`` replicas shard a stage's state (:data:`ZERO_STAGES`).
        per_node: devices per node; groups inside one node use the intra-node link
            (0: all devices in one node).
        order: the mesh's dimensions, outermost first (:data:`MESH_DIMENSIONS`).
        expert: the expert-parallel degree ``e``: the routed experts spread over ``e``
            of the ``D·c`` devices replicating a stage (``e`` divides ``D·c`` and every
            block's expert count, see :mod:`autopipe.planning.mesh.expert_figures`); the
            experts are not divided by the tensor-parallel group (expert tensor
            parallelism 1).
    """

    tensor: int = 1
    context: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    per_node: int = 0
    order: tuple[str, ...] = field(default=MESH_DIMENSIONS)
    expert: int = 1

    def __post_init__(self) -> None:
        for what in ("tensor", "context", "expert"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"mesh {what} degree is {value!r}; it must be an integer >= 1")
        per_node = self.per_node
        if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node < 0:
            raise ValueError(f"mesh per_node is {self.per_node!r}; it must be an integer >= 0")
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise ValueError(f"mesh zero is {self.zero!r}; choose one of 0, 1, 2, 3")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"mesh sequence_parallel is {self.sequence_parallel!r}; it must be true or false"
            )
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("sequence parallelism needs a tensor-parallel degree above 1")
        order = tuple(self.order)
        if sorted(order) != sorted(MESH_DIMENSIONS):
            raise ValueError(
                f"mesh order {list(order)} must name each of {', '.join(MESH_DIMENSIONS)} once"
            )
        object.__setattr__(self, "order", order)

    @property
    def inner(self) -> int:
        """Devices of one stage's tensor × context group."""
        return self.tensor * self.context

    def expert_replicas(self, replicas: int) -> int:
        """Devices holding the same routed experts of a stage, over which their gradients
        are summed and their ZeRO state sharded: ``t·D·c / e`` (the experts are whole on
        every device of a tensor-parallel group), at least 1."""
        return max(self.tensor * replicas * self.context // self.expert, 1)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "tensor": self.tensor,
            "context": self.context,
            "sequence_parallel": self.sequence_parallel,
            "zero": self.zero,
            "per_node": self.per_node,
            "order": list(self.order),
        }
        if self.expert > 1:  # meshes without expert parallelism read as before
            data["expert"] = self.expert
        return data

    @classmethod
    def from_dict(cls, data: object) -> Mesh:
        """Reads :meth:`to_dict`'s output.

        Raises:
            ValueError: not an object, an unknown field, or a value out of range.
        """
        if not isinstance(data, dict):
            raise ValueError(f"mesh must be an object, got {data!r}")
        known = {"tensor", "context", "sequence_parallel", "zero", "per_node", "order", "expert"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"mesh has unknown field {unknown[0]!r}")
        given = dict(data)
        if "order" in given:
            if not isinstance(given["order"], list):
                raise ValueError(f"mesh order must be a list, got {given['order']!r}")
            given["order"] = tuple(given["order"])
        return cls(**given)
