"""One fx GraphModule per unit, taking and returning the tensors live across its boundaries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from autopipe.graph.grad_modes import insert_grad_modes
from autopipe.graph.liveness import UnitIO
from autopipe.graph.tracing import PREFIX, Traced

__all__ = ["UnitModule", "UnitSequential"]


def _install_owners(module: fx.GraphModule, model: nn.Module) -> None:
    """Puts the model's batch-norm modules themselves where the graph reads their state.

    ``get_attr`` targets are copied under fresh containers; a batch-norm layer must be
    the real module so that re-computation in backward can restore its running statistics.
    """
    for node in module.graph.find_nodes(op="get_attr"):
        path, _, _ = str(node.target).rpartition(".")
        if not path.startswith(PREFIX + "."):
            continue
        try:
            owner = model.get_submodule(path[len(PREFIX) + 1 :])
        except AttributeError:
            continue
        if not isinstance(owner, _BatchNorm) or module.get_submodule(path) is owner:
            continue
        parent, _, name = path.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, name, owner)


def build_graph_module(traced: Traced, io: UnitIO, name: str = "Unit") -> fx.GraphModule:
    """The GraphModule running one unit: ``io.inputs`` in, ``io.outputs`` out, as a tuple.

    Parameters and buffers are the model's own (shared, not copied); constants of the
    trace are registered as buffers so that they move with the module. Devices that export
    baked into the graph are replaced by the device of the first input.
    """
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for value in io.inputs:
        env[value] = graph.placeholder(value.name)
    for attr in io.attrs:
        env[attr] = graph.node_copy(attr)
    for value, attr in io.aliases.items():
        env[value] = env[attr]
    for size, (tensor, dim) in io.sizes.items():
        env[size] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dim))
    device: list[fx.Node] = []

    def retarget(value: Any) -> Any:
        if isinstance(value, torch.device) and value == traced.device and io.inputs:
            if not device:
                with graph.inserting_after(env[io.inputs[-1]]):
                    device.append(graph.call_function(getattr, (env[io.inputs[0]], "device")))
            return device[0]
        return value

    for node in [*io.recompute, *io.nodes]:
        copy = graph.node_copy(node, env.__getitem__)
        if traced.device is not None:
            copy.args = fx.node.map_aggregate(copy.args, retarget)
            copy.kwargs = fx.node.map_aggregate(copy.kwargs, retarget)
        env[node] = copy
    graph.output(tuple(env[value] for value in io.outputs))
    insert_grad_modes(graph)  # the unit's part of each no_grad / enable_grad region
    module = fx.GraphModule(traced.root, graph, class_name=name)
    _install_owners(module, traced.model)
    return module


class UnitModule(nn.Module):
    """One unit of a wrapped model, as a layer of the pipeline's ``nn.Sequential``.

    Called with the live tensors as ``*args`` (or as one tuple, as GPipe passes them), it
    returns the tensors live after it as a tuple. It holds a graph per mode when the model
    traces differently in training and evaluation (dropout, batch norm), else one.

    Args:
        name: the unit's name (its module calls).
        graphs: ``{"train": ..., "eval": ...}``, or ``{"any": ...}`` for both modes.
    """

    def __init__(self, name: str, graphs: Mapping[str, fx.GraphModule]) -> None:
        super().__init__()
        self.name = name
        # ModuleDict keys may not shadow module attributes such as ``train``.
        self.modes = nn.ModuleDict({f"{key}_graph": graph for key, graph in graphs.items()})
        self.arity = {
            key: len(graph.graph.find_nodes(op="placeholder")) for key, graph in graphs.items()
        }

    @property
    def graphs(self) -> dict[str, fx.GraphModule]:
        """The graph of each mode key (``any``, or ``train`` and ``eval``)."""
        return {key.removesuffix("_graph"): graph for key, graph in self.modes.items()}  # type: ignore[misc]

    def _key(self) -> str:
        if "any" in self.arity:
            return "any"
        key = "train" if self.training else "eval"
        if key not in self.arity:
            raise RuntimeError(
                f"the model was traced in {next(iter(self.arity))} mode only; it cannot run "
                f"in {key} mode (see the warning wrap() gave)"
            )
        return key

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(args) == 1 and isinstance(args[0], tuple):
            args = args[0]
        key = self._key()
        expected = self.arity[key]
        if len(args) != expected:
            raise RuntimeError(
                f"unit {self.name} ({key}) expects {expected} tensors but got {len(args)}"
            )
        return tuple(self.modes[f"{key}_graph"](*args))

    def extra_repr(self) -> str:
        return f"name={self.name!r}"

    def cost_repr(self) -> str:
        """What of :meth:`extra_repr` changes the cost (the profiler pools by it): nothing."""
        return ""


class UnitSequential(nn.Sequential):
    """A wrapped model's units in order, called with the model's flattened input tensors.

    ``nn.Sequential`` takes one input; the first unit takes every input tensor, so this
    one is called as ``units(*tensors)`` (a sample of several tensors is its positional
    inputs, like any model's), and passes each unit's tuple on as one value.
    """

    @property
    def layer_names(self) -> list[str]:
        """The units' names, the dotted module names of ``named_modules()`` (``h.3``): the
        names a profile and a plan give the layers (child names cannot hold a dot)."""
        return [getattr(unit, "name", key) for key, unit in self.named_children()]

    def forward(self, *tensors: Any) -> Any:
        value: Any = tensors
        for unit in self:
            value = unit(value)
        return value
