"""torchtitan's config sections for a plan: parallelism degrees, recompute, batch sizes.

The key names are torchtitan 0.3.0's (``ParallelismConfig``, ``TrainingConfig`` of
``torchtitan.config``); its activation checkpointing is a choice of policy, written as
``[activation_checkpoint] mode`` with the policy's name (``full``, ``none``). torchtitan
0.3.0 reads its config from Python and takes each value as the command-line override
``--section.key value`` (the policy as ``activation-checkpoint:MODE``):
:func:`titan_overrides` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from typing import TYPE_CHECKING

from autopipe.planning.runtimes.layer_recompute import LayerStack, Stages
from autopipe.planning.runtimes.mesh_figures import MeshFigures, mesh_figures, world_line

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface

Sections = dict[str, dict[str, object]]


def _data_parallel(figures: MeshFigures) -> tuple[dict[str, object], list[str]]:
    """The replicate and shard degrees (and FSDP's resharding) for the plan's ZeRO stage.

    torchtitan replicates (DDP) or shards everything (FSDP, over the shard degree times
    the context group). FSDP keeping the parameters gathered from forward to backward
    (``never`` resharding) is the nearest it runs to ZeRO-1 and 2: gradients and
    optimizer state sharded, whole parameters only while a step runs."""
    replicas, zero = figures.replicas, figures.zero
    sharded = zero >= 1 and replicas > 1
    keys: dict[str, object] = {
        "data_parallel_replicate_degree": 1 if sharded else replicas,
        "data_parallel_shard_degree": replicas if sharded else 1,
    }
    fsdp = sharded or figures.context > 1
    notes = []
    if fsdp and zero in (1, 2):
        notes.append(
            f"ZeRO-{zero} has no torchtitan form; the nearest it runs: FSDP keeping the "
            'parameters gathered from forward to backward (fsdp_reshard_after_forward "never"), '
            "gradients and optimizer state sharded"
        )
    elif fsdp and zero == 0:
        notes.append(
            "with context parallelism torchtitan shards the parameters over the context "
            "group (FSDP over data_parallel_shard_degree x context_parallel_degree) where "
            "the plan keeps them whole"
        )
    if fsdp:  # ZeRO-3 gathers each unit as it runs; the others keep them gathered
        keys["fsdp_reshard_after_forward"] = "always" if zero == 3 else "never"
    return keys, notes


def _experts(figures: MeshFigures) -> tuple[dict[str, object], list[str]]:
    """The expert-parallel degree, for plans of models with routed experts, and what
    torchtitan runs otherwise than the plan.

    torchtitan 0.3.0 borrows its expert-parallel ranks from ``dp_shard · cp · tp`` (not
    from ``dp_replicate``), and the experts are whole on each of them."""
    if not figures.experts:
        return {}, []
    notes = []
    sharded = figures.zero >= 1 and figures.replicas > 1
    borrowed = (figures.replicas if sharded else 1) * figures.context * figures.tensor
    if borrowed % figures.expert:
        notes.append(
            f"torchtitan borrows expert parallelism from data_parallel_shard_degree x "
            f"context x tensor ({borrowed} ranks here), which {figures.expert} does not "
            "divide: shard the replicas (a ZeRO stage of 1 or more) to run this plan"
        )
    return {"expert_parallel_degree": figures.expert}, notes


def _sections(
    plan: Plan, parts: list[list[str]], schedule: str, stages: Stages
) -> tuple[Sections, MeshFigures]:
    """torchtitan's config sections for the plan (and the figures they come from)."""
    for asked, what, flag in (
        (plan.recompute_norms, "the norms", "--recompute-norms"),
        (plan.recompute_up_proj, "the attention's up-projections", "--recompute-up-proj"),
    ):
        if asked:
            raise ValueError(
                f"cannot export the plan as torchtitan: it re-computes {what} alone, which "
                "torchtitan's activation checkpointing has no mode for (its selective mode "
                "re-computes by operation, matrix products included); plan without "
                f"{flag}, or export to megatron"
            )
    # torchtitan checkpoints the entries of the model's ``layers`` (its transformer
    # blocks), all under one policy: a plan re-computing some of them gets ``full``.
    figures = mesh_figures(plan, "torchtitan", LayerStack("layers", stages, first=False))
    dp, notes = _data_parallel(figures)
    experts, expert_notes = _experts(figures)
    notes += expert_notes
    parallelism: dict[str, object] = {
        **dp,
        "tensor_parallel_degree": figures.tensor,
        # torchtitan's default is true: written always.
        "enable_sequence_parallel": figures.sequence_parallel,
        "context_parallel_degree": figures.context,
        "pipeline_parallel_degree": figures.ranks,
        **experts,
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
    if plan.sequence:  # the length the plan was counted at
        training["seq_len"] = plan.sequence
    parallelism["module_fqns_per_model_part"] = parts
    sections: Sections = {
        "parallelism": parallelism,
        "activation_checkpoint": {"mode": "full" if figures.recompute else "none"},
    }
    if training:
        sections["training"] = training
    return sections, dataclasses.replace(figures, notes=[*notes, *figures.notes])


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):  # module_fqns_per_model_part: one stage a line
        return "[\n" + "".join(f"    {json.dumps(names)},\n" for names in value) + "]"
    return json.dumps(value)


def titan_toml(plan: Plan, parts: list[list[str]], schedule: str, stages: Stages) -> str:
    """The TOML: the world size and notes as comments, the sections, the overrides.

    Args:
        plan: the plan.
        parts: ``module_fqns_per_model_part``, one list of module names per stage.
        schedule: torch's name of the plan's schedule.
        stages: per stage, per unit, the modules it calls.
    """
    sections, figures = _sections(plan, parts, schedule, stages)
    lines = [f"# torchtitan, {world_line(figures)}"]
    lines += [f"# note: {note}" for note in figures.notes]
    for section, keys in sections.items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in keys.items()]
    lines += [
        "",
        "# torchtitan 0.3.0 (configs in Python) takes the same as command-line overrides:",
        f"# {titan_overrides(sections)}",
    ]
    return "\n".join(lines) + "\n"


def titan_json(
    plan: Plan, parts: list[list[str]], schedule: str, stages: Stages
) -> dict[str, object]:
    """The JSON's object: the ``[parallelism]`` keys at the top level, the other sections
    as objects, ``world_size`` and the ``notes`` (arguments as :func:`titan_toml`'s)."""
    sections, figures = _sections(plan, parts, schedule, stages)
    data: dict[str, object] = {**sections.pop("parallelism"), **sections}
    data["world_size"] = figures.world
    data["notes"] = figures.notes
    return data


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
