"""Tensors used by several partitions: a later partition reads a copy made on its device."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

from profiler import tensor_uses

__all__: list[str] = []  # internal to the package

_KINDS = ("_parameters", "_buffers")


@dataclass
class _Copy:
    """Where a partition reads its copy of a tensor that an earlier partition owns."""

    name: str
    partition: int
    holder: nn.Module  # the partition's own clone of the module holding the tensor
    kind: str  # "_parameters" or "_buffers"
    key: str
    device: torch.device


def _clone(module: nn.Module) -> nn.Module:
    """A second handle on ``module``: the same parameter, buffer and hook dictionaries.

    The dictionaries are shared, not copied, so that moving or converting the original
    (``.to(dtype)``, ``load_state_dict``) is seen by the clone; only attributes set on the
    clone's own ``__dict__`` (the copies, its children) differ.
    """
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    return clone


def _direct(module: nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    for kind in _KINDS:
        for key, tensor in getattr(module, kind).items():
            if tensor is not None:
                yield kind, key, tensor


class Replicas:
    """The tensors of a GPipe that partitions on different devices use, and their copies.

    The first (lowest) partition using a tensor keeps the tensor itself; each later one on
    another device (or on any device with ``force``) gets clones of the modules on the
    path to it, which read a copy made by :meth:`refresh` at every forward. The copy of a
    parameter is differentiable (``tensor.to(device, copy=True)``), so autograd sums every
    copy's gradient into the one parameter: what the plain module's parameter receives,
    with checkpointing, accumulation over steps and ``zero_grad`` as usual. The module's
    own tree (``parameters()``, ``state_dict()``) never sees a copy.

    Args:
        partitions: the partitions, not yet on their devices; children that lead to a
            replicated tensor are replaced by clones in place.
        devices: the device of each partition.
        names: a name for each tensor, by ``id``.
        force: replicate on later partitions even when they share the owner's device.

    Raises:
        ValueError: a replicated tensor is written during forward (batch-norm running
            statistics) or read in a way a copy cannot replace (an RNN's flat weights).
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        devices: Sequence[torch.device],
        names: Mapping[int, str],
        force: bool = False,
    ) -> None:
        self.owner: dict[int, int] = {}
        self.tensors: dict[int, Tensor] = {}
        replicated: list[set[int]] = [set() for _ in partitions]
        for use in tensor_uses(partitions):
            owner, key = use.layers[0], id(use.tensor)
            later = [j for j in use.layers[1:] if force or devices[j] != devices[owner]]
            if later:
                self.owner[key] = owner
                self.tensors[key] = use.tensor
                for j in later:
                    replicated[j].add(key)
        self.names = {key: names.get(key, "<unnamed>") for key in self.owner}
        self.devices = list(devices)
        self.copies: list[_Copy] = []
        self.pairs: list[tuple[nn.Module, nn.Module]] = []
        for j, partition in enumerate(partitions):
            if replicated[j]:
                memo: dict[int, nn.Module] = {}
                for child_key, child in list(partition._modules.items()):
                    if child is not None:
                        partition._modules[child_key] = self._rewrite(child, j, replicated[j], memo)

    def _rewrite(
        self, module: nn.Module, j: int, replicated: set[int], memo: dict[int, nn.Module]
    ) -> nn.Module:
        """``module`` itself, or a clone reading copies where its tree holds a replicated
        tensor (one clone per module and partition, however many paths lead to it)."""
        if id(module) in memo:
            return memo[id(module)]
        children = {
            key: self._rewrite(child, j, replicated, memo)
            for key, child in module._modules.items()
            if child is not None
        }
        own = [(kind, key, t) for kind, key, t in _direct(module) if id(t) in replicated]
        if not own and all(children[k] is module._modules[k] for k in children):
            memo[id(module)] = module
            return module
        clone = _clone(module)
        modules = copy.copy(module._modules)
        modules.update(children)
        clone.__dict__["_modules"] = modules
        for kind, key, tensor in own:
            name = self.names[id(tensor)]
            where = f"{name} is used by partitions on different devices"
            if kind == "_buffers" and isinstance(module, _NormBase):
                raise ValueError(
                    f"{where}, but it is a running statistic of {type(module).__name__}, "
                    "written during forward: it cannot be replicated; keep the layers "
                    "using it on one device, or do not share the layer"
                )
            if isinstance(module, nn.RNNBase):
                raise ValueError(
                    f"{where}, but {type(module).__name__} reads its flat weights, not "
                    "its attributes: it cannot be replicated; keep its users on one device"
                )
            # An attribute in the instance's __dict__ wins over nn.Module.__getattr__,
            # which is where the shared parameter would be found otherwise.
            placeholder = torch.empty(0)
            clone.__dict__[key] = placeholder
            if getattr(clone, key) is not placeholder:  # a property on the class
                raise ValueError(f"{where}, but {type(module).__name__}.{key} cannot be replaced")
            self.copies.append(_Copy(name, j, clone, kind, key, self.devices[j]))
        self.pairs.append((clone, module))
        memo[id(module)] = clone
        return clone

    @property
    def stages(self) -> dict[str, tuple[int, ...]]:
        """Each replicated tensor's name and the partitions holding it, the owner first."""
        held: dict[str, list[int]] = {}
        for key, name in self.names.items():
            held[name] = [self.owner[key]]
        for item in self.copies:
            if item.partition not in held[item.name]:
                held[item.name].append(item.partition)
        return {name: tuple(parts) for name, parts in held.items()}

    def held(self) -> list[tuple[Tensor, tuple[int, ...]]]:
        """Each replicated tensor and the partitions holding it, the owner first."""
        stages = self.stages
        return [(self.tensors[key], stages[name]) for key, name in self.names.items()]

    def current(self) -> list[tuple[str, int, Tensor]]:
        """The copy each partition read at the last forward: name, partition, tensor."""
        return [(c.name, c.partition, getattr(c.holder, c.key)) for c in self.copies]

    @contextlib.contextmanager
    def moving(self, partitions: Sequence[nn.Module]) -> Iterator[None]:
        """Moves every replicated tensor to its owner's device; the partitions moved
        inside the block skip them (each later partition would pull them to its own)."""
        holders: list[tuple[dict[str, Tensor | None], str, int]] = []
        seen: set[tuple[int, str]] = set()
        for partition in partitions:
            for module in partition.modules():
                for kind, name, tensor in list(_direct(module)):
                    table = getattr(module, kind)
                    if id(tensor) in self.tensors and (id(table), name) not in seen:
                        seen.add((id(table), name))
                        holders.append((table, name, id(tensor)))
        # None, not removed: the entries keep their place, and so does state_dict()'s order.
        for table, name, _ in holders:
            table[name] = None
        try:
            yield
        finally:
            moved: dict[int, Tensor] = {}
            with torch.no_grad():
                for key, tensor in self.tensors.items():
                    device = self.devices[self.owner[key]]
                    if isinstance(tensor, nn.Parameter):
                        tensor.data = tensor.data.to(device)
                        if tensor.grad is not None:
                            tensor.grad = tensor.grad.to(device)
                        moved[key] = tensor
                    else:
                        moved[key] = tensor.to(device)
                    self.tensors[key] = moved[key]
            for table, name, key in holders:
                table[name] = moved[key]

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """Shows detached copies inside the block: ``copy.deepcopy`` refuses graph nodes."""
        saved = [(item, item.holder.__dict__[item.key]) for item in self.copies]
        for item, tensor in saved:
            item.holder.__dict__[item.key] = tensor.detach()
        try:
            yield
        finally:
            for item, tensor in saved:
                item.holder.__dict__[item.key] = tensor

    def refresh(self) -> None:
        """Makes each partition's copies from the tensors as they are now.

        Called before every forward, in the caller's grad mode: the copies of parameters
        that need a gradient carry one back to the parameter.
        """
        for clone, original in self.pairs:
            clone.training = original.training
        made: dict[tuple[int, int], Tensor] = {}
        for item in self.copies:
            source = getattr(item.holder, item.kind)[item.key]
            mark = (id(source), item.partition)
            if mark not in made:
                made[mark] = source.to(item.device, copy=True)
            item.holder.__dict__[item.key] = made[mark]
