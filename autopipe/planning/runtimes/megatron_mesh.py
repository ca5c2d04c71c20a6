"""Megatron-LM's arguments for a plan's mesh, batches and recompute.

The names are Megatron-LM's (``megatron/training/arguments.py``, most of them made from
megatron-core's ``TransformerConfig`` and ``DistributedDataParallelConfig`` fields): the
tensor- and context-parallel sizes, sequence parallelism, how the data-parallel group
shards (the distributed optimizer for ZeRO-1, Megatron-FSDP for ZeRO-2 and 3), the
routed experts (their count, top-k and the expert-model-parallel size, whose groups
Megatron forms inside the data- and context-parallel ranks; the experts' own tensor
parallelism 1), the micro- and global batch, and recompute: full recompute of every
decoder layer, or with the block method of the first ``N`` of every (virtual) stage, for
plans that re-compute some units (:mod:`autopipe.planning.runtimes.layer_recompute` rounds
them to that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.planning.runtimes.layer_recompute import BLOCK_METHOD, LayerStack, Stages
from autopipe.planning.runtimes.megatron_layout import decoder_stack
from autopipe.planning.runtimes.mesh_figures import MeshFigures, mesh_figures, world_line

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface

# Megatron-FSDP's sharding strategies: gradients and optimizer state (ZeRO-2), and the
# parameters too, gathered per module as it runs (ZeRO-3).
_FSDP_STRATEGIES = {2: "optim_grads", 3: "optim_grads_params"}
# Every layer's input kept, the layer recomputed in the backward: the plan's ``always``.
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
# Selective re-computation of the named modules (Megatron-LM's names): the plan's
# ``recompute_norms`` (every norm's output re-built from its input) and
# ``recompute_up_proj`` (the latent attention's queries, keys and values from its latents).
SELECTIVE = "--recompute-granularity selective --recompute-modules"
# The first N decoder layers of every stage kept as their input and recomputed, the rest
# not: the nearest Megatron runs to a plan re-computing some units (N follows).
RECOMPUTE_FIRST = f"--recompute-granularity full {BLOCK_METHOD} --recompute-num-layers"


def _sharding(figures: MeshFigures) -> list[str]:
    """The data-parallel sharding flags of the plan's ZeRO stage."""
    if figures.zero == 0:
        return []
    # The distributed optimizer shards the optimizer state (and fp32 main parameters)
    # over the data-parallel group; Megatron-FSDP v1 runs on it and shards more.
    flags = ["--use-distributed-optimizer"]
    if figures.zero in _FSDP_STRATEGIES:
        flags += [
            "--use-megatron-fsdp",
            f"--data-parallel-sharding-strategy {_FSDP_STRATEGIES[figures.zero]}",
            "--ckpt-format fsdp_dtensor",  # the checkpoint format Megatron-FSDP requires
        ]
    return flags


def megatron_mesh(plan: Plan, stages: Stages) -> tuple[str, list[str]]:
    """The mesh, batch and recompute flags, and the comment lines that go with them.

    The comments say the world size the degrees need and what the flags write
    differently from the plan.

    Args:
        plan: the plan.
        stages: per stage, per unit, the modules it calls.

    Raises:
        ValueError: no single stack of decoder layers among the modules.
    """
    stack = decoder_stack([path for units in stages for unit in units for path in unit])
    figures = mesh_figures(plan, "Megatron", LayerStack(stack, stages, first=True))
    flags = [f"--tensor-model-parallel-size {figures.tensor}"]
    notes = list(figures.notes)
    sequence_parallel = figures.sequence_parallel
    if figures.experts and figures.tensor > 1 and not sequence_parallel:
        sequence_parallel = True
        notes.append(
            "Megatron runs routed experts with tensor parallelism only under sequence "
            "parallelism: --sequence-parallel is written, which the plan did not weigh"
        )
    if sequence_parallel:
        flags.append("--sequence-parallel")
    flags.append(f"--context-parallel-size {figures.context}")
    if figures.experts:
        flags.append(f"--num-experts {figures.experts}")
        flags.append(f"--moe-router-topk {figures.top_k}")
        flags.append(f"--expert-model-parallel-size {figures.expert}")
        if figures.tensor > 1:  # Megatron's default is the dense layers' degree
            flags.append("--expert-tensor-parallel-size 1")
    flags += _sharding(figures)
    if figures.micro_batch is not None:
        # Megatron runs global / (micro · data-parallel size) micro-batches per step.
        flags.append(f"--micro-batch-size {figures.micro_batch}")
        flags.append(f"--global-batch-size {figures.global_batch}")
    if plan.sequence:  # the length the plan was counted at
        flags.append(f"--seq-length {plan.sequence}")
    asked = {"layernorm": plan.recompute_norms, "mla_up_proj": plan.recompute_up_proj}
    modules = [name for name, flag in asked.items() if flag]
    if modules and figures.recompute:
        flag = "--recompute-norms" if plan.recompute_norms else "--recompute-up-proj"
        raise ValueError(
            f"cannot export the plan as megatron: it re-computes whole layers and "
            f"{' and '.join(modules)} modules, and Megatron-LM's --recompute-granularity "
            f"takes one of them (full or selective); plan with --checkpoint never and "
            f"{flag}, or without it"
        )
    if modules:
        flags.append(f"{SELECTIVE} {' '.join(modules)}")
    elif figures.recompute_layers is not None:
        flags.append(f"{RECOMPUTE_FIRST} {figures.recompute_layers}")
    elif figures.recompute:
        flags.append(RECOMPUTE)
    if plan.schedule != "1f1b":
        # Its pipeline schedules are 1F1B and, with virtual stages, interleaved 1F1B.
        notes.append(
            f"Megatron-LM runs its 1F1B schedule, not the plan's {plan.schedule}: the split "
            "holds, but the step and memory are those of --schedule 1f1b (plan with it to "
            "see them)"
        )
    comments = [f"# Megatron-LM, {world_line(figures)}"]
    comments += [f"# note: {note}" for note in notes]
    return " ".join(flags), comments
