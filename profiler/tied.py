"""The parameters and buffers that several layers of a model use: one tensor, counted in each."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from profiler.profile import TiedState

__all__ = ["tied_state"]


def tied_state(
    layers: Sequence[nn.Module], names: Sequence[str], owner: nn.Module | None = None
) -> list[TiedState]:
    """The parameters and buffers that several of ``layers`` use, by identity.

    Each layer is profiled on a copy of its own, so every user counts such a tensor in its
    ``param_bytes``; the planner needs to know which, to hold it once per stage.

    Args:
        layers: the layers, in order.
        names: their names, which name a tensor without ``owner``: ``layer.param``.
        owner: the model the layers take their parameters from (a model traced into
            units, the ``nn.Sequential`` itself), whose names for the tensor are listed.
    """
    known: dict[int, list[str]] = {}
    if owner is not None:
        for name, tensor in [
            *owner.named_parameters(remove_duplicate=False),
            *owner.named_buffers(remove_duplicate=False),
        ]:
            known.setdefault(id(tensor), []).append(name)
    found: dict[int, tuple[Tensor, bool, list[int], list[str]]] = {}
    for index, (layer, layer_name) in enumerate(zip(layers, names, strict=True)):
        state = [
            *((n, t, False) for n, t in layer.named_parameters()),
            *((n, t, True) for n, t in layer.named_buffers()),
        ]
        for name, tensor, buffer in state:
            entry = found.setdefault(id(tensor), (tensor, buffer, [], []))
            if index not in entry[2]:
                entry[2].append(index)
                entry[3].append(f"{layer_name}.{name}")
    tied = []
    for key, (tensor, buffer, users, local) in found.items():
        if len(users) > 1:
            tied.append(
                TiedState(
                    names=known.get(key) or local,
                    layers=users,
                    bytes=tensor.numel() * tensor.element_size(),
                    buffer=buffer,
                )
            )
    return tied
