"""What a runtime re-computes of a plan's checkpointing, rounded up to what it can express.

A plan re-computes whole stages (checkpoint ``never``, ``except_last``, ``always``) or, per
stage, the units its ``recompute_units`` list (``units``). The runtimes take less:
torchtitan 0.3.0 applies one policy to every transformer block (the entries of the
model's ``layers``), Megatron-LM one mode to every decoder layer, or with its block method
the first ``N`` decoder layers of every (virtual) stage. A plan's choice is rounded up to
what the runtime runs: more re-computation (time) than planned, never more memory on the
layers the runtime checkpoints (the safe side of a memory budget). Each rounding comes
with a note; so do the re-computed units that are no transformer layer (the embedding,
the loss), which neither runtime checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface

Stages = Sequence[Sequence[Sequence[str]]]  # per stage, per unit, the modules it calls
# Megatron's block method: the first --recompute-num-layers decoder layers of each stage.
BLOCK_METHOD = "--recompute-method block"


@dataclass(frozen=True)
class LayerStack:
    """Where a plan's units lie among the transformer layers a runtime checkpoints.

    Attributes:
        stack: the module whose numbered entries are the layers (``layers`` of ``layers.3``).
        stages: per stage, per unit, the modules the unit calls.
        first: the runtime can re-compute the first ``N`` layers of every stage
            (Megatron's block method); else it applies one mode to every layer.
    """

    stack: str
    stages: Stages
    first: bool


@dataclass(frozen=True)
class Recompute:
    """What the runtime is told to re-compute.

    Attributes:
        on: it re-computes at all.
        first: it re-computes the first ``first`` layers of every stage (Megatron's block
            method); ``None``: every layer.
        notes: what differs from the plan.
    """

    on: bool
    first: int | None = None
    notes: list[str] = field(default_factory=list)


def _except_last(runtime: str) -> str:
    return (
        f"checkpoint except_last (every micro-batch but the last recomputes) has no "
        f"{runtime} form: the export recomputes every micro-batch, the last one too"
    )


def whole_stages(plan: Plan, runtime: str) -> Recompute:
    """One mode for every layer: recompute everywhere when any stage recomputes.

    More time than planned where a stage was planned with less, never more memory."""
    modes = plan.stage_checkpoints
    if all(mode == "never" for mode in modes):
        return Recompute(on=False)
    notes = [_except_last(runtime)] if "except_last" in modes else []
    some = [k for k, mode in enumerate(modes) if mode == "units"]
    if some:
        notes.append(
            f"stages {some} re-compute some of their units; {runtime} applies one mode to "
            "all the layers, so they re-compute all of them"
        )
    plain = [k for k, mode in enumerate(modes) if mode == "never"]
    if plain:
        notes.append(
            f"stages {plain} were planned without recompute; {runtime} applies one mode to "
            "all the layers, so they recompute too"
        )
    return Recompute(on=True, notes=notes)


def _listed(word: str, indices: Sequence[int]) -> str:
    """``unit 3``, ``units 3, 5``, ``no unit``."""
    if not indices:
        return f"no {word}"
    return f"{word}{'s' if len(indices) > 1 else ''} {', '.join(str(i) for i in indices)}"


def _layers_of(paths: Sequence[str], stack: str) -> tuple[set[int], bool]:
    """The stack's layers a unit's modules lie in, and whether it calls any other module."""
    layers, other, prefix = set(), False, stack + "."
    for path in paths:
        index = path[len(prefix) :].split(".")[0] if path.startswith(prefix) else ""
        if index.isdigit():
            layers.add(int(index))
        else:
            other = True
    return layers, other


@dataclass
class _Stages:
    """Per stage: each unit's layers, the layers the stage runs and those planned."""

    units: list[list[set[int]]]
    own: list[list[int]]
    planned: list[set[int]]
    chosen: list[set[int]]  # the re-computed units' positions in the stage


def _read(plan: Plan, runtime: str, where: LayerStack) -> tuple[_Stages, list[str]]:
    """The plan's re-computation in layers of the stack, and the notes on units outside it."""
    found = _Stages([], [], [], [])
    notes = []
    modes = plan.stage_checkpoints
    for k, (stage, paths) in enumerate(zip(plan.stages, where.stages, strict=True)):
        read = [_layers_of(unit, where.stack) for unit in paths]
        units = [layers for layers, _ in read]
        chosen = set(range(len(units))) if modes[k] in ("always", "except_last") else set()
        if modes[k] == "units":
            chosen = {u - stage.start for u in stage.recompute_units}
        outside = [repr(stage.layers[i]) for i in sorted(chosen) if read[i][1]]
        if outside:
            notes.append(
                f"stage {k} re-computes units {', '.join(outside)}, which run modules outside "
                f"the layers of {where.stack!r}: {runtime} checkpoints only those layers, so "
                "it keeps these units' activations, more memory than planned"
            )
        found.units.append(units)
        found.own.append(sorted(set().union(*units)))
        found.planned.append(set().union(*(units[i] for i in chosen)))
        found.chosen.append(chosen)
    if "except_last" in modes:
        notes.append(_except_last(runtime))
    return found, notes


def _more(plan: Plan, found: _Stages, k: int, runs: set[int]) -> bool:
    """Stage ``k`` re-computes more than planned when it runs ``runs`` under checkpointing."""
    if plan.stage_checkpoints[k] != "units":
        return bool(runs - found.planned[k])
    return any(units & runs for i, units in enumerate(found.units[k]) if i not in found.chosen[k])


def _first_layers(plan: Plan, found: _Stages, notes: list[str]) -> Recompute:
    """Megatron's block method: ``N`` covers every stage's last planned layer."""
    needs = [
        max(own.index(layer) for layer in planned) + 1 if planned else 0
        for own, planned in zip(found.own, found.planned, strict=True)
    ]
    first = max(needs)
    if not first:
        return Recompute(on=False, notes=notes)
    how = (
        f"{BLOCK_METHOD} --recompute-num-layers {first} re-computes the first {first} of "
        "every stage"
    )
    for k, stage in enumerate(plan.stages):
        own = found.own[k]
        runs = own[:first]
        if not _more(plan, found, k, set(runs)):
            continue
        exported = f"all its {len(own)}" if len(runs) == len(own) else f"its first {len(runs)}"
        if plan.stage_checkpoints[k] == "never":
            notes.append(
                f"stage {k} was planned without recompute; {how}: it re-computes {exported} "
                "decoder layers, more re-computation than planned"
            )
            continue
        offsets = [own.index(layer) for layer in sorted(found.planned[k])]
        notes.append(
            f"stage {k} re-computes {_listed('unit', stage.recompute_units)} "
            f"(its {_listed('decoder layer', offsets)} of {len(own)}): exported as "
            f"{exported} ({how}), more re-computation than planned"
        )
    return Recompute(on=True, first=first, notes=notes)


def _one_policy(plan: Plan, runtime: str, where: LayerStack, found: _Stages) -> list[str]:
    """The note of a runtime re-computing every layer where the plan re-computes some."""
    every = set().union(*found.own)
    rounded = [k for k in range(plan.num_stages) if _more(plan, found, k, set(found.own[k]))]
    if not rounded:
        return []
    planned = _listed("layer", sorted(set().union(*found.planned)))
    return [
        f"the plan re-computes {planned} (or units of them) of the {len(every)} in "
        f"{where.stack!r}, stages {rounded} not all of theirs; {runtime} applies one "
        "activation-checkpointing policy to every layer, with no per-layer choice: it "
        f"re-computes all {len(every)}, more re-computation than planned"
    ]


def layer_recompute(plan: Plan, runtime: str, where: LayerStack) -> Recompute:
    """What the runtime re-computes of the plan, and what differs from it.

    Plans with no ``units`` stage keep :func:`whole_stages`' one mode for every layer.

    Args:
        plan: the plan.
        runtime: the runtime's name, for the notes.
        where: where the plan's units lie among the runtime's layers.
    """
    if "units" not in plan.stage_checkpoints:
        return whole_stages(plan, runtime)
    found, notes = _read(plan, runtime, where)
    if where.first:
        return _first_layers(plan, found, notes)
    if not any(found.planned):
        return Recompute(on=False, notes=notes)
    return Recompute(on=True, notes=[*notes, *_one_policy(plan, runtime, where, found)])
