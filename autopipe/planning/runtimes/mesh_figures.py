"""What the torchtitan and Megatron exports write about a plan's mesh, batches and recompute.

One place decides the figures both runtimes take: the degrees (``t · c · K · D`` devices),
the ZeRO stage the replicas shard with, the micro- and global batch, and the one recompute
mode a runtime applies to every layer. Each figure a runtime cannot take exactly comes with
a note saying what the export writes instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
        recompute: the runtime recomputes every layer's activations in the backward.
        notes: what the runtimes cannot take as planned and what is written instead.
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
    notes: list[str] = field(default_factory=list)


def zero_stage(plan: Plan) -> int:
    """The plan's ZeRO stage; plans that only set ``shard_optimizer`` are stage 1."""
    return max(plan.mesh.zero, 1 if plan.shard_optimizer else 0)


def _recompute(plan: Plan, runtime: str) -> tuple[bool, list[str]]:
    """Whether the runtime recomputes, and what differs from the plan's per-stage modes.

    Both runtimes apply one mode to every decoder layer of every micro-batch, so a plan
    that recomputes anywhere recomputes everywhere there: more time than planned, never
    more memory (the safe side of a memory budget)."""
    modes = plan.stage_checkpoints
    if all(mode == "never" for mode in modes):
        return False, []
    notes = []
    if "except_last" in modes:
        notes.append(
            f"checkpoint except_last (every micro-batch but the last recomputes) has no "
            f"{runtime} form: the export recomputes every micro-batch, the last one too"
        )
    plain = [k for k, mode in enumerate(modes) if mode == "never"]
    if plain:
        notes.append(
            f"stages {plain} were planned without recompute; {runtime} applies one mode to "
            "all the layers, so they recompute too"
        )
    return True, notes


def mesh_figures(plan: Plan, runtime: str) -> MeshFigures:
    """The figures of the mesh, batches and recompute that ``runtime`` is given.

    Args:
        plan: the plan.
        runtime: the runtime's name, for the notes (``torchtitan``, ``Megatron``).
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
    recompute, why = _recompute(plan, runtime)
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
        recompute=recompute,
        notes=[*notes, *why],
    )


def world_line(figures: MeshFigures) -> str:
    """The world size and how its degrees multiply, for a comment line."""
    return (
        f"world size {figures.world} = tensor {figures.tensor} x context {figures.context} "
        f"x pipeline {figures.ranks} x data {figures.replicas}"
    )
