"""A model built on the meta device: each rank materializes only its own stages."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.graph.meta import materialize_units, rebind_state, unused_meta

__all__: list[str] = []  # internal to the distributed runner


def init_problem(model: nn.Module, meta: bool, init: object) -> str | None:
    """What is wrong with an ``init=`` argument, or ``None``."""
    if init is not None and not callable(init):
        return f"init must be callable as init(part), got {type(init).__name__}"
    if init is not None and not meta:
        return (
            f"init= initializes the tensors of a model built on the meta device, but "
            f"{type(model).__name__} has none on meta; initialize it before building the "
            'pipeline, or build it under torch.device("meta")'
        )
    return None


def materialize_stages(
    model: nn.Module,
    layers: Sequence[nn.Module],
    balance: Sequence[int],
    mine: Sequence[int],
    device: torch.device,
    init: Callable[[nn.Module], None] | None,
) -> None:
    """Gives the meta tensors of this rank's stages storage on ``device`` and initializes
    them (see :func:`autopipe.graph.meta.materialize_units`); the other stages' stay on meta.

    Each stage is materialized on its own, seeded by its index, ``init(part)`` called once
    per stage; a tensor two of this rank's stages use is the first one's. Afterwards every
    layer's graphs read the model's current tensors, so that tensors several stages use
    are still found by identity.

    Raises:
        ValueError: a tensor that nothing initializes (without ``init``), see
            :func:`autopipe.graph.meta.materialize_units`.
    """
    starts = [sum(balance[:s]) for s in range(len(balance))]
    stages = [list(layers[start : start + size]) for start, size in zip(starts, balance)]
    extra = unused_meta(model, stages)
    for stage in sorted(mine):
        materialize_units(model, stages[stage], device, init, seed=stage, extra=extra[stage])
    for layer in layers:
        rebind_state(layer, model)


def broadcast_ties(parts: Sequence[tuple[dist.ProcessGroup | None, list[Tensor]]]) -> None:
    """Copies the first holder's value of each parameter tied across ranks to the others;
    a collective of the holders (``TiedGradients.parts``: sets in the same order on every
    rank, the first position the group's rank 0).

    Copies that each rank materialized and initialized on its own start equal then, as
    those of a model built for real do.
    """
    with torch.no_grad():
        for group, params in parts:
            for param in params:
                dist.broadcast(param.data, group_src=0, group=group)
