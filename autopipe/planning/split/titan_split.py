"""torchtitan's default split of a decoder-only model, as its users get it (for comparison)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from autopipe import PlanningError

__all__ = ["has_titan_shape"]

# torchtitan's defaults: ``pipeline_parallel_first_stage_less_layers`` and
# ``..._last_stage_less_layers`` (the embedding and norm + output each weigh one layer).
INPUT_WEIGHT = 1
OUTPUT_WEIGHT = 1

# The first numeric part of a module's dotted name: ``layers.3.attention`` is in layer 3
# of the stack ``layers``.
_LAYER = re.compile(r"^(.+?)\.(\d+)(?:\.|$)")


def titan_layer_counts(
    stages: int,
    num_layers: int,
    input_weight: int = INPUT_WEIGHT,
    output_weight: int = OUTPUT_WEIGHT,
) -> list[int]:
    """Transformer layers per stage, as torchtitan 0.3.0's
    ``torchtitan.distributed.pipeline_parallel._generate_llm_fqn_per_model_part`` places them.

    The embedding counts as ``input_weight`` layers and norm + output as
    ``output_weight``; the ``num_layers + input_weight + output_weight`` effective layers
    are spread evenly, the first ``effective % stages`` stages one more. The first stage
    holds the embedding and its count less ``input_weight`` layers, the last its count
    less ``output_weight`` layers and norm + output.

    Args:
        stages: number of stages (virtual ones included), at least 1.
        num_layers: transformer layers of the model.
        input_weight: what the embedding weighs, in layers.
        output_weight: what norm + output weigh, in layers.

    Returns:
        The number of transformer layers on each stage (the first and last may hold none).

    Raises:
        PlanningError: torchtitan refuses the configuration (more stages than effective
            layers, or a stage whose share is below the embedding's or output's weight).
    """
    if stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    share, extra = divmod(effective, stages)
    if share < max(1, input_weight, output_weight):
        raise PlanningError(
            f"torchtitan's default split refuses {stages} stages for {num_layers} layers: "
            f"{effective} effective layers (the layers, {input_weight} for the embedding, "
            f"{output_weight} for norm + output) give {share} per stage, below one layer "
            "or the embedding's or output's weight; use fewer stages"
        )
    counts = [share + (1 if k < extra else 0) for k in range(stages)]
    counts[0] -= input_weight
    counts[-1] -= output_weight
    return counts


def torchtitan(names: Sequence[str], stages: int) -> list[int]:
    """The balance, in units, of torchtitan's default split (no ``module_fqns_per_model_part``).

    The units must have torchtitan's model shape: one or more units before a stack of
    decoder layers (the embedding), the layers (units named ``PREFIX.N``, consecutive, each
    unit inside one layer), one or more units after it (norm + output). Each layer's units
    go where torchtitan puts the layer, the embedding's with the first stage and the
    output's with the last.

    Args:
        names: the units' names in order, as a profile has them (``a+b`` for a unit of
            several module calls, ``m#2`` for a module's second call).
        stages: number of stages, virtual ones included.

    Returns:
        The number of units in each stage.

    Raises:
        PlanningError: the units do not have torchtitan's shape, or torchtitan refuses
            the stage count.
    """
    groups, head, tail = _layer_groups(list(names))
    counts = titan_layer_counts(stages, len(groups))
    balance = []
    taken = 0
    for count in counts:
        balance.append(sum(groups[taken : taken + count]))
        taken += count
    balance[0] += head
    balance[-1] += tail
    return balance


def has_titan_shape(names: Sequence[str]) -> bool:
    """Whether units of these names have torchtitan's model shape (see :func:`torchtitan`):
    the strategy applies to them, for some stage counts."""
    try:
        _layer_groups(list(names))
    except PlanningError:
        return False
    return True


def _layer_of(unit: str) -> tuple[str, int] | None:
    """The one decoder layer ``(prefix, index)`` every call of ``unit`` lies in, if any."""
    found = set()
    for label in unit.replace("/", ".").split("+"):
        match = _LAYER.match(label.partition("#")[0])
        found.add((match.group(1), int(match.group(2))) if match else None)
    if len(found) > 1:
        raise PlanningError(
            f"unit {unit!r} spans several layers (or a layer and other modules); "
            "torchtitan splits between whole layers: plan with one unit per layer or smaller"
        )
    return found.pop()


def _layer_groups(names: list[str]) -> tuple[list[int], int, int]:
    """Units per decoder layer, and the units before (embedding) and after (output)."""
    layers = [_layer_of(name) for name in names]
    prefixes = {found[0] for found in layers if found is not None}
    if len(prefixes) != 1:
        what = (
            "no stack of layers (units named PREFIX.N)"
            if not prefixes
            else (f"{len(prefixes)} stacks of layers ({', '.join(sorted(prefixes))})")
        )
        raise PlanningError(
            f"strategy 'torchtitan' needs a decoder-only model (embedding, layers PREFIX.N, "
            f"norm + output) but the units have {what}"
        )
    inside = [i for i, found in enumerate(layers) if found is not None]
    first, last = inside[0], inside[-1]
    if first == 0 or last == len(names) - 1:
        side = "before" if first == 0 else "after"
        raise PlanningError(
            f"strategy 'torchtitan' needs units {side} the decoder layers (the "
            f"{'embedding' if first == 0 else 'norm + output'}), and the model has none"
        )
    groups: list[int] = []
    order: list[int] = []
    for name, found in zip(names[first : last + 1], layers[first : last + 1], strict=True):
        if found is None:
            raise PlanningError(
                f"unit {name!r} runs between the decoder layers but is none of them; "
                "torchtitan's default split places only layers there"
            )
        if order and order[-1] == found[1]:
            groups[-1] += 1
            continue
        if found[1] in order:
            raise PlanningError(f"decoder layer {found[0]}.{found[1]} runs twice, apart")
        order.append(found[1])
        groups.append(1)
    if order != list(range(order[0], order[0] + len(order))):
        raise PlanningError(
            f"the decoder layers run in the order {order}, not one after the other; "
            "torchtitan's default split counts consecutive layers"
        )
    return groups, first, len(names) - 1 - last
