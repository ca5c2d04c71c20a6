"""The parameters and buffers that several layers of a model use: one tensor, counted in each."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from profiler.profile import TiedState

__all__ = ["tensor_uses"]


@dataclass
class TensorUse:
    """A parameter or buffer of some layers, and the layers that use it.

    Attributes:
        tensor: the tensor.
        buffer: a buffer, not a parameter.
        layers: the indices of the layers using it, ascending.
        names: its name in each of those layers (the layer's own naming), in that order.
    """

    tensor: Tensor
    buffer: bool
    layers: list[int]
    names: list[str]


def tensor_uses(layers: Sequence[nn.Module]) -> list[TensorUse]:
    """Every parameter and buffer of ``layers``, by identity, in order of first use (a
    layer's parameters, then its buffers).

    The profiler, the single-process GPipe and the distributed runner each need to know
    which layers (or stages: pass the stages' modules) share a tensor; this is the one
    place that finds out.
    """
    found: dict[int, TensorUse] = {}
    for index, layer in enumerate(layers):
        state = [
            *((n, t, False) for n, t in layer.named_parameters()),
            *((n, t, True) for n, t in layer.named_buffers()),
        ]
        for name, tensor, buffer in state:
            use = found.setdefault(id(tensor), TensorUse(tensor, buffer, [], []))
            if index not in use.layers:
                use.layers.append(index)
                use.names.append(name)
    return list(found.values())


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
    if len(names) != len(layers):
        raise ValueError(f"got {len(names)} names for {len(layers)} layers")
    known: dict[int, list[str]] = {}
    if owner is not None:
        for name, tensor in [
            *owner.named_parameters(remove_duplicate=False),
            *owner.named_buffers(remove_duplicate=False),
        ]:
            known.setdefault(id(tensor), []).append(name)
    tied = []
    for use in tensor_uses(layers):
        if len(use.layers) > 1:
            local = [f"{names[k]}.{name}" for k, name in zip(use.layers, use.names, strict=True)]
            tensor = use.tensor
            tied.append(
                TiedState(
                    names=known.get(id(tensor)) or local,
                    layers=use.layers,
                    bytes=tensor.numel() * tensor.element_size(),
                    buffer=use.buffer,
                )
            )
    return tied
