"""Parameters and written buffers used by several units: shared, replicated, or refused."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.fx as fx
from torch import Tensor, nn

from profiler import physical_device

__all__ = ["check_placement", "copied_written", "graph_writes"]


@dataclass(frozen=True)
class SharedState:
    """A parameter or written buffer of the model that more than one unit uses.

    Attributes:
        name: its (first) qualified name in the model.
        units: the indices of the units that read it.
    """

    name: str
    units: tuple[int, ...]


def unit_state(root: nn.Module, nodes: Iterable[fx.Node]) -> list[Tensor]:
    """The state a unit must share with every other unit using it.

    Args:
        root: the module the graph's targets resolve in.
        nodes: the unit's ``get_attr`` and ``call_module`` nodes.

    Returns:
        The parameters it uses, and the buffers it uses that some node of the graph may
        write (every buffer of a called module, which may update it). A buffer that is only
        read (a causal mask, position ids) may be copied to every device that needs it.
    """
    found: list[Tensor] = []
    for node in nodes:
        target = str(node.target)
        obj = root.get_submodule(target) if _is_module(root, target) else _attr(root, target)
        if isinstance(obj, nn.Module):
            found.extend(chain(obj.parameters(), obj.buffers()))
        elif isinstance(obj, nn.Parameter) or (isinstance(obj, Tensor) and _written(node)):
            found.append(obj)
    return found


def unit_writes(root: nn.Module, nodes: Iterable[fx.Node]) -> list[Tensor]:
    """The tensors a unit may write in place during forward: a copy of them cannot stand in.

    Args:
        root: the module the graph's targets resolve in.
        nodes: the unit's ``get_attr`` and ``call_module`` nodes.

    Returns:
        Every buffer of a called module (which may update it, as batch norm does) and each
        tensor read by ``get_attr`` that some node of the graph writes.
    """
    found: list[Tensor] = []
    for node in nodes:
        target = str(node.target)
        if _is_module(root, target):
            found.extend(root.get_submodule(target).buffers())
        else:
            obj = _attr(root, target)
            if isinstance(obj, Tensor) and _written(node):
                found.append(obj)
    return found


def find_written(model: nn.Module, writes: Iterable[Iterable[Tensor]]) -> set[str]:
    """The names (as :func:`find_shared` gives them) of the tensors some unit may write.

    Args:
        model: the model, which names the tensors.
        writes: for each unit, what it may write (see :func:`unit_writes`).
    """
    names = _names(model)
    return {names[id(t)] for tensors in writes for t in tensors if id(t) in names}


def _names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    named = chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    for name, tensor in named:
        names.setdefault(id(tensor), name)
    return names


def graph_writes(root: fx.GraphModule) -> list[tuple[nn.Module, str]]:
    """The buffers ``root``'s graph may write in place, as ``(owner module, name)``: those
    read by ``get_attr`` that some node writes, and every buffer of a called module (which
    may update it, as batch norm does)."""
    found: dict[tuple[int, str], tuple[nn.Module, str]] = {}
    for node in root.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        if _is_module(root, target):
            for owner in root.get_submodule(target).modules():
                for name, buffer in owner._buffers.items():
                    if buffer is not None:
                        found[id(owner), name] = (owner, name)
            continue
        path, _, name = target.rpartition(".")
        owner = root.get_submodule(path) if path else root
        if owner._buffers.get(name) is not None and _written(node):
            found[id(owner), name] = (owner, name)
    return list(found.values())


def _written(attr: fx.Node) -> bool:
    """Whether some node of the graph may write the tensor that ``attr`` reads."""
    same = [n for n in attr.graph.find_nodes(op="get_attr") if n.target == attr.target]
    return any(_writes(user, node) for node in same for user in node.users)


def _writes(user: fx.Node, value: fx.Node) -> bool:
    if user.op == "call_module":
        return True
    target = user.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        for i, argument in enumerate(schema.arguments):
            given = user.args[i] if i < len(user.args) else user.kwargs.get(argument.name)
            alias = argument.alias_info
            written = alias is not None and alias.is_write
            # aten.batch_norm updates its running statistics without saying so.
            if given is value and (written or argument.name.startswith("running_")):
                return True
        return False
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    in_place = name.endswith("_") and not name.endswith("__")
    return in_place and bool(user.args) and user.args[0] is value


def _attr(root: nn.Module, target: str) -> object:
    path, _, name = target.rpartition(".")
    return getattr(root.get_submodule(path) if path else root, name)


def _is_module(root: nn.Module, target: str) -> bool:
    try:
        root.get_submodule(target)
    except AttributeError:
        return False
    return True


def find_shared(model: nn.Module, state: Sequence[Iterable[Tensor]]) -> list[SharedState]:
    """The model's tensors that several units use.

    Args:
        model: the model, which names the tensors.
        state: for each unit, its state (see :func:`unit_state`).
    """
    names = _names(model)
    users: dict[int, set[int]] = {}
    for k, tensors in enumerate(state):
        for tensor in tensors:
            if id(tensor) in names:
                users.setdefault(id(tensor), set()).add(k)
    return [
        SharedState(names[key], tuple(sorted(units)))
        for key, units in users.items()
        if len(units) > 1
    ]


def adjacent_boundaries(shared: Iterable[SharedState]) -> set[int]:
    """Boundaries between consecutive units that share one of ``shared``."""
    return {a for s in shared for a, b in zip(s.units, s.units[1:]) if b == a + 1}


def copied_written(
    shared: Iterable[SharedState],
    devices: Sequence[str],
    written: Collection[str],
    replicate: bool = False,
) -> list[str]:
    """The shared tensors written during forward that stages on ``devices`` would copy.

    Stages on one device share a tensor; stages on different devices (any stages with
    ``replicate``) each read a copy, which must not be of a tensor written in place. The
    planner keeps the users of those returned on one stage
    (:func:`autopipe.planning.model.cut_rules.keep_together`). With stages on several devices
    every such tensor is returned, even where two of the stages share a device: the split
    is not known yet.

    Args:
        shared: the tensors several units use.
        devices: the device of each stage.
        written: the names of the tensors some unit may write (:func:`find_written`).
        replicate: whether stages on one device get copies too.
    """
    one_device = len({physical_device(name) for name in devices}) == 1
    if one_device and not (replicate and len(devices) > 1):
        return []
    return [item.name for item in shared if item.name in written]


def check_placement(
    shared: Iterable[SharedState],
    stage_of_unit: Sequence[int],
    devices: Sequence[str],
    unit_names: Sequence[str],
    written: Collection[str] = (),
    replicate: bool = False,
) -> None:
    """Refuses a placement that needs a copy of a tensor that is written during forward.

    Stages on the same device share a tensor: its gradient accumulates in one place.
    Stages on different devices (any stages with ``replicate``) each hold a copy of a
    parameter or read-only buffer (see :class:`autopipe.gpipe.GPipe`); a tensor the units
    write in place (running statistics, a counter) would have copies that drift apart.

    Args:
        shared: the tensors several units use.
        stage_of_unit: the stage of each unit.
        devices: the device of each stage.
        unit_names: the name of each unit, for the message.
        written: the names of the tensors some unit may write (:func:`find_written`).
        replicate: whether stages on one device get copies too.

    Raises:
        ValueError: a written parameter or buffer would be needed on two devices (or two
            stages with ``replicate``); the message names it and its units.
    """
    for item in shared:
        if item.name not in written:
            continue
        stages = {stage_of_unit[u] for u in item.units}
        placed = {physical_device(devices[k]) for k in stages}
        if len(placed) > 1 or (replicate and len(stages) > 1):
            where = ", ".join(
                f"{unit_names[u]} (stage {stage_of_unit[u]}, {devices[stage_of_unit[u]]})"
                for u in item.units
            )
            raise ValueError(
                f"{item.name} is shared by units on different devices: {where}; it is "
                "written during forward, so it cannot be replicated on each of them: give "
                "those stages the same device, use fewer stages, or untie it"
            )
