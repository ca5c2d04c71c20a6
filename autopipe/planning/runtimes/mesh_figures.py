"""What the torchtitan and Megatron exports write about a plan's mesh, batches and recompute.

One place decides the figures both runtimes take: the degrees (``t · c · K · D`` devices,
expert parallelism ``e`` inside ``D · c``, with the routed experts and top-k of the
profile's mixture-of-experts blocks), the ZeRO stage the replicas shard with, the micro-
and global batch, and which layers the runtime recomputes
(:mod:`autopipe.planning.runtimes.layer_recompute` rounds the plan's per-stage and per-unit
choices up to that). Each figure a runtime cannot take exactly
comes with a note saying what the export writes instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopipe.planning.runtimes.layer_recompute import LayerStack, layer_recompute, whole_stages

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface


@dataclass(frozen=True)
class MeshFigures:
    """A plan's parallel layout and batches as the runtimes count them.

    Attributes:
        ranks: pipeline ranks ``K`` (the plan's stages over its virtual stages).
        replicas: data-parallel replicas ``D``.
        tensor: tensor-parallel degree ``t``.
        context: context-parallel degree ``c``.
        sequence_parallel: the tensor-parallel group splits activations along the sequence.
        zero: the ZeRO stage of the replicas (0 to 3).
        world: devices the runtime needs, ``t · c · K · D``.
        micro_batch: samples per micro-batch, ``None`` when the plan's batch is unknown.
        chunks: micro-batches per replica and step.
        global_batch: samples per step over all replicas, ``micro_batch · chunks · D``
            (``None`` when unknown).
        recompute: the runtime recomputes activations in the backward.
        recompute_layers: it recomputes the first this many transformer layers of every
            stage (Megatron's block method); ``None``: every layer.
        notes: what the runtimes cannot take as planned and what is written instead.
        expert: expert-parallel degree ``e`` (inside the ``D · c`` ranks).
        experts: routed experts per mixture-of-experts block (0: no routed experts).
        top_k: experts each token goes to (0: no routed experts).
    """

    ranks: int
    replicas: int
    tensor: int
    context: int
    sequence_parallel: bool
    zero: int
    world: int
    micro_batch: int | None
    chunks: int
    global_batch: int | None
    recompute: bool
    recompute_layers: int | None = None
    notes: list[str] = field(default_factory=list)
    expert: int = 1
    experts: int = 0
    top_k: int = 0


def zero_stage(plan: Plan) -> int:
    """The plan's ZeRO stage; plans that only set ``shard_optimizer`` are stage 1."""
    return max(plan.mesh.zero, 1 if plan.shard_optimizer else 0)


def routed_experts(plan: Plan) -> tuple[int, int]:
    """``(experts, top_k)`` of the first layer with routed experts in the plan's profile
    record, ``(0, 0)`` without any (runtimes take one count for every block)."""
    layers = plan.profile.get("layers", []) if isinstance(plan.profile, dict) else []
    for layer in layers:
        found = layer.get("experts") if isinstance(layer, dict) else None
        if isinstance(found, dict) and found.get("blocks"):
            return int(found["experts"]), int(found["top_k"])
    return 0, 0


def mesh_figures(plan: Plan, runtime: str, layers: LayerStack | None = None) -> MeshFigures:
    """The figures of the mesh, batches and recompute that ``runtime`` is given.

    Args:
        plan: the plan.
        runtime: the runtime's name, for the notes (``torchtitan``, ``Megatron``).
        layers: where the plan's units lie among the runtime's transformer layers, to
            round per-unit re-computation to what the runtime runs
            (:mod:`autopipe.planning.runtimes.layer_recompute`); ``None``: one mode for
            every layer, whatever the plan's units.
    """
    mesh, replicas = plan.mesh, plan.data_parallel
    ranks = plan.num_stages // plan.virtual_stages
    world = mesh.tensor * mesh.context * ranks * replicas
    notes = []
    if world != plan.num_devices:
        notes.append(
            f"the plan runs some stages on one device in turns ({plan.num_devices} devices); "
            f"{runtime} gives every rank's stages a device of their own: {world} devices"
        )
    micro: int | None = plan.micro_batch if plan.batch_size > 0 and plan.micro_batch > 0 else None
    total = None if micro is None else micro * plan.chunks * replicas
    if micro is None:
        notes.append("the plan's batch size is unknown: no batch sizes are written")
    elif total != plan.batch_size:
        notes.append(
            f"the plan's batch of {plan.batch_size} samples rounds up to {total} = "
            f"{replicas} replica(s) x {plan.chunks} micro-batches x {micro} samples"
        )
    # The profile records the sample's bytes, not its shape: the sequence length is unknown.
    notes.append(
        "the sequence length is not in the plan: set it to the length of the profiled sample"
    )
    recompute = (
        whole_stages(plan, runtime) if layers is None else layer_recompute(plan, runtime, layers)
    )
    experts, top_k = routed_experts(plan)
    return MeshFigures(
        ranks=ranks,
        replicas=replicas,
        tensor=mesh.tensor,
        context=mesh.context,
        sequence_parallel=mesh.sequence_parallel,
        zero=zero_stage(plan),
        world=world,
        micro_batch=micro,
        chunks=plan.chunks,
        global_batch=total,
        recompute=recompute.on,
        recompute_layers=recompute.first,
        notes=[*notes, *recompute.notes],
        expert=mesh.expert,
        experts=experts,
        top_k=top_k,
    )


def world_line(figures: MeshFigures) -> str:
    """The world size and how its degrees multiply, for a comment line."""
    expert = f" (expert {figures.expert} within data x context)" if figures.expert > 1 else ""
    return (
        f"world size {figures.world} = tensor {figures.tensor} x context {figures.context} "
        f"x pipeline {figures.ranks} x data {figures.replicas}{expert}"
    )
