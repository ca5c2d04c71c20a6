"""Megatron-LM's pipeline layout of a decoder-only model: embedding, layers, loss per stage."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__: list[str] = []  # autopipe.planning.runtimes.export_formats is the interface

# The first numeric part of a module's dotted name: ``transformer.h.3.attn`` is part of
# layer 3 of the stack ``transformer.h``.
_LAYER = re.compile(r"^(.+?)\.(\d+)(?:\.|$)")

Stages = Sequence[Sequence[Sequence[str]]]  # per stage, per unit, the modules it calls


def _layer(path: str) -> tuple[str, int] | None:
    match = _LAYER.match(path)
    return (match.group(1), int(match.group(2))) if match else None


def decoder_stack(paths: Sequence[str]) -> str:
    """The prefix of the one stack of repeated layers (``layers`` of ``layers.N``)."""
    indices: dict[str, set[int]] = {}
    for path in paths:
        found = _layer(path)
        if found is not None:
            indices.setdefault(found[0], set()).add(found[1])
    stacks = [prefix for prefix, seen in indices.items() if len(seen) >= 2]
    if not stacks:
        raise ValueError(
            "no stack of decoder layers (units named PREFIX.N) among the plan's units; the "
            "megatron format describes decoder-only transformers"
        )
    if len(stacks) > 1:
        raise ValueError(
            f"the model has {len(stacks)} stacks of layers ({', '.join(stacks)}); Megatron's "
            "layout describes a decoder-only model with one"
        )
    return stacks[0]


def decoder_counts(stages: Stages) -> list[int]:
    """Decoder layers per stage, checking that Megatron can place the rest.

    Units before the first decoder layer are the embedding (``E``, on the first stage),
    those after the last one the loss (``L``: final norm, output layer, on the last).

    Raises:
        ValueError: no single stack of layers, a cut inside a decoder layer, the
            embedding or the loss off its stage, or other modules between the layers.
    """
    flat = [(k, path) for k, units in enumerate(stages) for unit in units for path in unit]
    prefix = decoder_stack([path for _, path in flat])
    inside = [i for i, (_, path) in enumerate(flat) if (_layer(path) or ("",))[0] == prefix]
    first, last = inside[0], inside[-1]
    where: dict[int, tuple[int, str]] = {}
    order: list[int] = []
    for k, path in flat[first : last + 1]:
        found = _layer(path)
        if found is None or found[0] != prefix:
            raise ValueError(
                f"unit {path!r} (stage {k}) runs between the decoder layers of {prefix!r} "
                "but is none of them; Megatron's layout holds only decoder layers there"
            )
        seen = where.setdefault(found[1], (k, path))
        if seen[0] != k:
            raise ValueError(
                f"the cut between stages {seen[0]} and {k} (units {seen[1]!r} and {path!r}) "
                f"lies inside decoder layer {prefix}.{found[1]}, which Megatron counts as "
                "one layer ('t'); plan with whole layers as units"
            )
        if not order or order[-1] != found[1]:
            order.append(found[1])
    if order != list(range(order[0], order[0] + len(order))):
        raise ValueError(
            f"the decoder layers of {prefix!r} run in the order {order}, not one after the "
            "other; Megatron's layout counts consecutive layers"
        )
    for k, path in flat[:first]:
        if k != 0:
            raise ValueError(
                f"unit {path!r}, before the first decoder layer, is in stage {k}; Megatron "
                "puts the embedding ('E') and what precedes the layers on the first stage"
            )
    for k, path in flat[last + 1 :]:
        if k != len(stages) - 1:
            raise ValueError(
                f"unit {path!r}, after the last decoder layer, is in stage {k}; Megatron "
                "puts the loss ('L': final norm, output layer) on the last stage"
            )
    counts = [0] * len(stages)
    for k, _ in where.values():
        counts[k] += 1
    return counts


def layout_string(counts: Sequence[int]) -> str:
    """``--pipeline-model-parallel-layout``: the stages in order, split by ``|``."""

    def stage(k: int, count: int) -> str:
        layers = "t" * count if count < 3 else f"t*{count}"
        return ("E" if k == 0 else "") + layers + ("L" if k == len(counts) - 1 else "")

    return "|".join(stage(k, count) for k, count in enumerate(counts))


def first_last_counts(counts: Sequence[int], ranks: int) -> tuple[int, int] | str:
    """The first and last ranks' decoder layers when they describe the split, else why not.

    That is ``--decoder-first/last-pipeline-num-layers``: Megatron gives the middle ranks
    equal counts and each rank's virtual stages equal shares of its layers.
    """
    if ranks < 2:
        return "one rank, no pipeline"
    virtual = len(counts) // ranks
    if virtual > 1 and ranks == 2:
        # Megatron 0.16's get_transformer_layer_offset divides the middle ranks' layers by
        # their count there, so the last rank would fail with ZeroDivisionError.
        return "with virtual stages Megatron needs a middle rank (its offsets divide by 0)"
    per_rank = [[counts[r + j * ranks] for j in range(virtual)] for r in range(ranks)]
    for r, chunks in enumerate(per_rank):
        if len(set(chunks)) > 1:
            return f"rank {r}'s virtual stages hold {chunks} layers, not equal shares"
    totals = [chunks[0] * virtual for chunks in per_rank]
    if len(set(totals[1:-1])) > 1:
        return f"the middle ranks hold {totals[1:-1]} layers, not equal counts"
    for r in (0, ranks - 1):
        if not totals[r]:  # Megatron refuses counts of 0 there
            return f"rank {r} holds no decoder layer"
    return totals[0], totals[-1]


def megatron_arguments(stages: Stages, ranks: int, mesh: str = "") -> str:
    """Megatron-LM's arguments for the split: the layout, and first/last counts if they can.

    Args:
        stages: per stage, per unit, the modules it calls.
        ranks: pipeline ranks.
        mesh: further flags every command line carries (the mesh, batches, recompute).

    Raises:
        ValueError: see :func:`decoder_counts`.
    """
    counts = decoder_counts(stages)
    virtual = len(stages) // ranks
    total = f"--num-layers {sum(counts)} --pipeline-model-parallel-size {ranks}"
    rest = f" {mesh}" if mesh else ""
    lines = [
        f"# a decoder-only model of {sum(counts)} layers: the layout",
        f'{total} --pipeline-model-parallel-layout "{layout_string(counts)}"{rest}',
    ]
    counted = first_last_counts(counts, ranks)
    if isinstance(counted, str):
        lines.append(f"# not expressible by --decoder-first/last-pipeline-num-layers: {counted}")
    else:
        vpp = f" --num-virtual-stages-per-pipeline-rank {virtual}" if virtual > 1 else ""
        lines += [
            "# or the same split by the first and last ranks' layer counts",
            f"{total}{vpp} --decoder-first-pipeline-num-layers {counted[0]} "
            f"--decoder-last-pipeline-num-layers {counted[1]}{rest}",
        ]
    return "\n".join(lines) + "\n"
