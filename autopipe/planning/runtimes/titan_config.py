"""torchtitan's config sections for a plan: parallelism degrees, recompute, batch sizes.

The key names are torchtitan 0.3.0's (``ParallelismConfig``, ``TrainingConfig`` of
``torchtitan.config``); its activation checkpointing is a choice of policy, written as
``[activation_checkpoint] mode`` with the policy's name (``full``, ``none``). torchtitan
0.3.0 reads its config from Python and takes each value as the command-line override
``--section.key value`` (the policy as ``activation-checkpoint:MODE``):
:func:`titan_overrides` writes them.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from autopipe.planning.runtimes.mesh_figures import MeshFigures, mesh_figures, world_line

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface

Sections = dict[str, dict[str, object]]


def _data_parallel(figures: MeshFigures) -> tuple[dict[str, object], list[str]]:
    """The replicate and shard degrees (and FSDP's resharding) for the plan's ZeRO stage.

    torchtitan replicates (DDP) or shards everything (FSDP); FSDP that keeps the
    parameters gathered from forward to backward (``never`` resharding) is ZeRO-2, the
    nearest it runs to ZeRO-1 and 2."""
    replicas, zero = figures.replicas, figures.zero
    sharded = zero >= 1 and replicas > 1
    keys: dict[str, object] = {
        "data_parallel_replicate_degree": 1 if sharded else replicas,
        "data_parallel_shard_degree": replicas if sharded else 1,
    }
    notes = []
    if zero in (1, 2) and replicas > 1:
        notes.append(
            f"ZeRO-{zero} has no torchtitan form: the replicas run FSDP keeping the "
            "parameters gathered from forward to backward (fsdp_reshard_after_forward "
            '"never"), which shards the gradients and optimizer state (ZeRO-2)'
        )
    if figures.context > 1 and not sharded:
        notes.append(
            "with context parallelism torchtitan shards the parameters over the context "
            "group (FSDP over data_parallel_shard_degree x context_parallel_degree) "
            f"where the plan (ZeRO-{zero}) keeps them whole"
        )
    if sharded or figures.context > 1:  # FSDP runs: gather per unit (ZeRO-3) or keep
        keys["fsdp_reshard_after_forward"] = "always" if zero == 3 else "never"
    return keys, notes


def titan_sections(
    plan: Plan, parts: list[list[str]], schedule: str
) -> tuple[Sections, list[str], int]:
    """torchtitan's config sections for the plan, the notes and the world size.

    The notes say what the sections write differently from the plan, the first one the
    world size the degrees multiply to (torchtitan checks it against its ranks).

    Args:
        plan: the plan.
        parts: ``module_fqns_per_model_part``, one list of module names per stage.
        schedule: torch's name of the plan's schedule.
    """
    figures = mesh_figures(plan, "torchtitan")
    dp, notes = _data_parallel(figures)
    parallelism: dict[str, object] = {
        **dp,
        "tensor_parallel_degree": figures.tensor,
        # torchtitan's default is true: written always.
        "enable_sequence_parallel": figures.sequence_parallel,
        "context_parallel_degree": figures.context,
        "pipeline_parallel_degree": figures.ranks,
        "pipeline_parallel_schedule": schedule,
    }
    training: dict[str, object] = {}
    if figures.micro_batch is not None and figures.global_batch is not None:
        parallelism["pipeline_parallel_microbatch_size"] = figures.micro_batch
        # local_batch_size is one data-parallel rank's batch of one step, split into the
        # pipeline's micro-batches; without a pipeline the micro-batches accumulate.
        pipelined = figures.ranks > 1
        local = figures.micro_batch * (figures.chunks if pipelined else 1)
        training = {"local_batch_size": local, "global_batch_size": figures.global_batch}
    parallelism["module_fqns_per_model_part"] = parts
    sections: Sections = {
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": "full" if figures.recompute else "none"},
    }
    if training:
        sections["training"] = training
    return sections, [world_line(figures), *notes, *figures.notes], figures.world


def _override(section: str, key: str, value: object) -> list[str]:
    flag = f"--{section}.{key}"
    if isinstance(value, bool):
        return [flag if value else f"--{section}.no-{key}"]
    if isinstance(value, list):  # a list of lists of names: one comma-separated word each
        return [flag, *(",".join(names) for names in value)]
    return [flag, str(value)]


def titan_overrides(sections: Sections) -> str:
    """The sections as torchtitan 0.3.0's command-line overrides, the policy last."""
    words: list[str] = []
    for section, keys in sections.items():
        if section == "activation_checkpoint":
            continue
        for key, value in keys.items():
            words += _override(section, key, value)
    words.append(f"activation-checkpoint:{sections['activation_checkpoint']['mode']}")
    return shlex.join(words)
