"""Per-unit re-computation: a partition that runs some of its layers under checkpointing.

A plan made with ``checkpoint="auto"`` may re-compute single units of a stage instead of
the whole stage (``StagePlan.checkpoint == "units"``): each listed unit runs under
activation checkpointing on every micro-batch, keeping only its input, and runs its
forward again in backward. :class:`RecomputedUnits` is such a partition; the other layers
run and keep their activations as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopipe.gpipe.checkpoint import checkpoint
from autopipe.gpipe.microbatch import Batch, check

if TYPE_CHECKING:
    from autopipe.planning import Plan

__all__: list[str] = []  # internal to the package

UNITS = "units"


class RecomputedUnits(nn.Sequential):
    """An ``nn.Sequential`` partition whose layers at ``units`` re-compute in backward.

    In training with gradients on, each layer at a position of ``units`` runs as a
    checkpointed micro-batch of its own (:func:`autopipe.gpipe.checkpoint.checkpoint`):
    only its input is kept, its random number generator state is replayed in backward,
    batch-norm running statistics move once, and ``is_checkpointing()`` /
    ``is_recomputing()`` are true during its first run and its re-run. Otherwise (eval,
    ``no_grad``) every layer runs plainly, as nothing is kept for backward then.

    Args:
        layers: the partition's layers by name, in order.
        units: the positions (within the partition) of the layers to re-compute.
        device: the partition's device, whose generator state a re-computation replays.
    """

    def __init__(
        self, layers: OrderedDict[str, nn.Module], units: Sequence[int], device: torch.device
    ) -> None:
        super().__init__(layers)
        self.units = frozenset(units)
        self.device = device

    def forward(self, input: Any) -> Any:
        recompute = self.training and torch.is_grad_enabled()
        value = input
        for position, (name, layer) in enumerate(self._modules.items()):
            assert layer is not None
            if recompute and position in self.units:
                # A checkpointed layer takes and returns its value as a Batch; a tuple
                # subclass (a named tuple) would reach the layer as a plain tuple.
                if isinstance(value, tuple) and type(value) is not tuple:
                    raise TypeError(
                        f"layer {name!r} is re-computed, which passes its input on as a "
                        f"plain tuple; it got a {type(value).__name__}: return a plain tuple "
                        "from the layer before, or do not re-compute this layer"
                    )
                check(value, f"the input of re-computed layer {name!r}")
                value = checkpoint(layer, Batch(value), self.device).value
            else:
                value = layer(value)
        return value

    def __getitem__(self, index: Any) -> Any:
        # A slice has other positions: it is a plain Sequential of the same layers.
        if isinstance(index, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[index]))
        return super().__getitem__(index)

    def extra_repr(self) -> str:
        return f"recompute={sorted(self.units)}"


def recompute_lists(
    recompute: object, modes: Sequence[str], balance: Sequence[int]
) -> list[list[int]]:
    """Checks ``recompute`` against the partitions' modes and returns it, one sorted list
    of positions per partition (empty where a partition re-computes no single layer).

    Args:
        recompute: the ``recompute`` argument of GPipe: ``None``, or one sequence of
            layer positions (within the partition) per partition.
        modes: each partition's checkpoint mode.
        balance: each partition's number of layers.

    Raises:
        ValueError: a ``units`` partition without positions, positions for a partition of
            another mode, a position outside its partition or listed twice, or not one
            list per partition.
    """
    n = len(balance)
    if recompute is None:
        if UNITS in modes:
            j = list(modes).index(UNITS)
            raise ValueError(
                f"partition {j} has checkpoint 'units' but recompute is not given; pass "
                "recompute=[[positions], ...], one list of layer positions per partition"
            )
        return [[] for _ in range(n)]
    if not isinstance(recompute, (list, tuple)) or len(recompute) != n:
        count = len(recompute) if isinstance(recompute, (list, tuple)) else None
        got = f"{count} lists" if count is not None else repr(recompute)
        raise ValueError(
            f"recompute needs one list of layer positions per partition ({n}), got {got}"
        )
    lists: list[list[int]] = []
    for j, (entry, mode, size) in enumerate(zip(recompute, modes, balance, strict=True)):
        ok = isinstance(entry, (list, tuple)) and all(
            isinstance(u, int) and not isinstance(u, bool) for u in entry
        )
        if not ok:
            raise ValueError(f"recompute[{j}] is {entry!r}; it must be a list of integer positions")
        positions = list(entry)
        if mode != UNITS and positions:
            raise ValueError(
                f"recompute[{j}] lists {positions} but partition {j} has checkpoint "
                f"{mode!r}; give it checkpoint 'units' or an empty list"
            )
        if mode == UNITS and not positions:
            raise ValueError(
                f"partition {j} has checkpoint 'units' but recompute[{j}] is empty; list the "
                "layers to re-compute or give it checkpoint 'never'"
            )
        outside = [u for u in positions if not 0 <= u < size]
        if outside:
            raise ValueError(
                f"recompute[{j}] has position {outside[0]} but partition {j} has {size} "
                f"layer{'s' if size != 1 else ''} (positions 0 to {size - 1})"
            )
        if len(set(positions)) != len(positions):
            raise ValueError(f"recompute[{j}] is {positions}: list each layer position once")
        lists.append(sorted(positions))
    return lists


def plan_recomputation(plan: Plan) -> tuple[str | list[str], list[list[int]] | None]:
    """The ``checkpoint`` and ``recompute`` arguments of GPipe that run ``plan`` as planned.

    A plan made with ``checkpoint="auto"`` gives one mode per stage; its ``units`` stages
    list the units they re-compute by their index in the model, here made positions
    within the stage's partition.

    Raises:
        ValueError: a plan GPipe does not run (:meth:`Plan.check_runnable`).
    """
    plan.check_runnable("GPipe")
    units = any(stage.checkpoint == UNITS for stage in plan.stages)
    if plan.checkpoint != "auto" and not units:
        return plan.checkpoint, None
    modes = plan.stage_checkpoints
    if not units:
        return modes, None
    return modes, [[u - stage.start for u in stage.recompute_units] for stage in plan.stages]
