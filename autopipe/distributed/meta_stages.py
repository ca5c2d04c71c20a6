"""A model built on the meta device: each rank materializes only its own stages."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

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
