"""Sharded data parallelism (ZeRO-2/3): each stage's state split over its D replicas.

With ``zero`` 2 or 3 the D replicas of a stage do not each hold its parameters whole:
every traced unit of the stage becomes one unit of torch's ``fully_shard`` (FSDP2) on the
replica group's device mesh, as torchtitan wraps each transformer block, and the stage
module itself the root unit. A rank then keeps ``1/D`` of every parameter (dim 0, padded
to a multiple of D), its gradient and so its optimizer state. A unit's parameters are
all-gathered before its forward and its gradients reduce-scattered (averaged) after its
backward, so the one gathered unit in flight is one unit, as the planner prices it
(:mod:`autopipe.planning.mesh.zero_exchange`).

* ZeRO-3: ``reshard_after_forward=True``; a unit's gathered parameters are freed after
  its forward and gathered again for its backward.
* ZeRO-2: ``reshard_after_forward=False`` (FSDP2's ZeRO-2 analogue); they stay gathered
  from forward to backward.

torch's pipeline stages drive the units between micro-batches as torchtitan's pipelines
do: the gradients of the earlier micro-batches accumulate unsharded, and only the last
backward of a step reduce-scatters them (``set_requires_gradient_sync``) and reshards,
then the schedule finalizes the reduction (``PipelineStage.perform_reduce_grad``). The
reduced gradient is added to the shard's earlier ``.grad``, so accumulation over steps
without ``zero_grad`` keeps ``earlier + mean(this step)`` as plain replicas do.

ZeRO-1 (optimizer state sharded, parameters and gradients whole) runs as plain replicas:
the gradients are all-reduced and the optimizer is the caller's (e.g. torch's
``ZeroRedundancyOptimizer`` over the replica group shards its state).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopipe.distributed.stage import StageModule
from autopipe.planning import ZERO_STAGES

__all__: list[str] = []  # internal to the distributed runner


def resolve_zero(given: Any, plan: Any) -> Any:
    """The ZeRO stage to run: ``given``, else the plan's ``mesh.zero``, else 0."""
    if given is not None:
        return given
    return getattr(getattr(plan, "mesh", None), "zero", 0)


def zero_problem(zero: Any, data_parallel: int, tensor_parallel: int) -> str | None:
    """What refuses sharding the replicas at ZeRO stage ``zero``, or ``None``."""
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        return f"zero must be one of {', '.join(map(str, ZERO_STAGES))}, got {zero!r}"
    if zero >= 2 and tensor_parallel > 1:
        return (
            f"zero={zero} with tensor_parallel={tensor_parallel} is not run by the "
            "distributed runner; pass zero=0 or tensor_parallel=1"
        )
    return None


def replica_mesh(group: dist.ProcessGroup, device_type: str) -> DeviceMesh:
    """The 1-D device mesh of a stage's replica group."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("dp",))


def shard_stages(module: nn.Module, mesh: DeviceMesh, zero: int) -> int:
    """Shards every stage of ``module`` over ``mesh`` with ``fully_shard``, one unit each.

    Each child of a :class:`~autopipe.distributed.stage.StageModule` (a traced unit) that
    has parameters becomes its own FSDP unit, then the stage module the root of its units
    (the module torch's ``PipelineStage`` runs, which drives the units per micro-batch).

    Args:
        module: this rank's stages (after the replicas were made equal).
        mesh: the replica group's mesh (:func:`replica_mesh`).
        zero: 2 (parameters stay gathered from forward to backward) or 3 (freed after
            forward).

    Returns:
        The FSDP units made (the units and the stage roots).
    """
    # Imported here: plain pipelines do not load FSDP's modules.
    from torch.distributed.fsdp import fully_shard

    reshard = zero == 3
    stages = [m for m in module.modules() if isinstance(m, StageModule)]
    units = 0
    for stage in stages:
        for unit in list(stage.children()):
            if any(True for _ in unit.parameters()):
                fully_shard(unit, mesh=mesh, reshard_after_forward=reshard)
                units += 1
        fully_shard(stage, mesh=mesh, reshard_after_forward=reshard)
        units += 1
    return units


def whole(value: Tensor) -> Tensor:
    """``value`` whole: a sharded (DTensor) value gathered over its mesh (a collective:
    the replicas pass the same tensors in the same order), any other tensor as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value
