"""Deferred batch norm for a pipeline's layers: traced units rewritten, other layers copied."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from autopipe.graph import UnitModule
from autopipe.microbatching.batchnorm import deferred_copy, tracks_statistics

__all__ = ["defer_layers"]

_BATCH_NORM = torch.ops.aten.batch_norm.default
# aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, ...)
_ARGUMENTS: tuple[str, ...] = ("input", "weight", "bias", "running_mean", "running_var")
_ARGUMENTS += ("training", "momentum", "eps")


def _argument(node: fx.Node, index: int) -> Any:
    return node.args[index] if index < len(node.args) else node.kwargs.get(_ARGUMENTS[index])


def _reads(value: Any, path: str, name: str, affine: bool) -> bool:
    """Whether a batch-norm argument is the layer's own ``weight`` or ``bias`` (or none)."""
    if not affine:
        return value is None
    return (
        isinstance(value, fx.Node) and value.op == "get_attr" and value.target == f"{path}.{name}"
    )


def _other_update(node: fx.Node) -> bool:
    """Whether ``node`` is some other batch-norm call that updates running statistics: the
    functional form (the fx path traces it through custom modules) or another aten op."""
    if node.op != "call_function" or node.target is _BATCH_NORM:
        return False
    if node.target is F.batch_norm:
        names = ["input", "running_mean", "running_var", "weight", "bias", "training"]
    elif isinstance(node.target, torch._ops.OpOverload):
        names = [argument.name for argument in node.target._schema.arguments]
    else:
        return False
    if "running_mean" not in names or "training" not in names:
        return False

    def given(name: str) -> Any:
        index = names.index(name)
        return node.args[index] if index < len(node.args) else node.kwargs.get(name)

    return given("training") is True and given("running_mean") is not None


def _tracked(module: nn.Module) -> bool:
    return isinstance(module, _BatchNorm) and module.track_running_stats


def _cannot_defer(node: fx.Node) -> ValueError:
    return ValueError(
        f"a batch_norm call in training ({node.name}) does not use one BatchNorm layer's own "
        "parameters and statistics, so its running statistics cannot be deferred; pass "
        "deferred_batch_norm=False"
    )


class _Rewriter:
    """Defers the batch-norm calls of the units' training graphs, leaving the model as is.

    A graph reads the model's modules through containers of its own; the first of the
    model's modules on the path to a batch-norm layer is replaced there (only there) by
    its :func:`~autopipe.microbatching.batchnorm.deferred_copy`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self.cache: dict[int, nn.Module] = {}
        self.calls: Counter[int] = Counter()

    def _install(self, graph: fx.GraphModule, path: str) -> None:
        parent: nn.Module = graph
        for item in path.split("."):
            child = parent._modules[item]
            assert child is not None
            if id(child) in self.names:
                parent._modules[item] = deferred_copy(child, self.cache)
                return
            parent = child

    def _count(self, module: nn.Module) -> None:
        for inner in module.modules():
            if _tracked(inner) and id(inner) in self.names:
                self.calls[id(inner)] += 1

    def _defer_call(self, graph: fx.GraphModule, node: fx.Node) -> None:
        """Replaces a functional batch norm on a module's statistics with a call of it."""
        running = _argument(node, 3)
        owner_path = ""
        if isinstance(running, fx.Node) and running.op == "get_attr":
            owner_path = str(running.target).rpartition(".")[0]
        owner = graph.get_submodule(owner_path) if owner_path else None
        same = (
            isinstance(owner, _BatchNorm)
            and owner.track_running_stats
            and id(owner) in self.names
            and _argument(node, 6) == owner.momentum
            and _argument(node, 7) == owner.eps
            and _reads(_argument(node, 1), owner_path, "weight", owner.affine)
            and _reads(_argument(node, 2), owner_path, "bias", owner.affine)
        )
        if not same or owner is None:
            raise _cannot_defer(node)
        self._count(owner)
        self._install(graph, owner_path)
        with graph.graph.inserting_before(node):
            call = graph.graph.call_module(owner_path, (_argument(node, 0),))
        node.replace_all_uses_with(call)
        graph.graph.erase_node(node)

    def _drop_counting(self, graph: fx.GraphModule) -> None:
        """Removes the graph's increments of batch-norm counters, and reads left unused.

        A deferred layer counts its batches itself, once per step, and every batch-norm
        call in training is deferred (or refused), wherever its increment landed.
        """
        for attr in graph.graph.find_nodes(op="get_attr"):
            path, _, name = str(attr.target).rpartition(".")
            if not (path and _tracked(graph.get_submodule(path))):
                continue
            increments = [u for u in attr.users if u.target is torch.ops.aten.add_.Tensor]
            for user in increments if name == "num_batches_tracked" else []:
                if not user.users:
                    graph.graph.erase_node(user)
            if not attr.users:
                graph.graph.erase_node(attr)

    def graph(self, graph: fx.GraphModule) -> None:
        for node in list(graph.graph.nodes):
            if node.op == "call_module":
                module = graph.get_submodule(str(node.target))
                if tracks_statistics(module):
                    self._count(module)
                    self._install(graph, str(node.target))
            elif (
                node.op == "call_function"
                and node.target is _BATCH_NORM
                and _argument(node, 5) is True
                and _argument(node, 3) is not None
            ):
                self._defer_call(graph, node)
            elif _other_update(node):
                raise _cannot_defer(node)
        self._drop_counting(graph)
        graph.graph.lint()
        graph.recompile()

    def check_calls(self) -> None:
        for key, count in self.calls.items():
            if count > 1:
                raise ValueError(
                    f"BatchNorm {self.names[key]!r} runs {count} times per forward; deferred "
                    "statistics would merge its calls into one update per step: pass "
                    "deferred_batch_norm=False"
                )


def defer_layers(layers: Mapping[str, nn.Module], model: nn.Module) -> OrderedDict[str, nn.Module]:
    """The pipeline's layers with every batch-norm layer deferred; ``model`` is left as is.

    Traced units (:class:`~autopipe.graph.stage_modules.UnitModule`, the pipeline's own) are
    rewritten in place: in their training graphs each batch-norm call runs a
    :class:`~autopipe.microbatching.batchnorm.DeferredBatchNorm` over the layer's own parameters and
    buffers. Other layers (the model's own modules) are replaced by their
    :func:`~autopipe.microbatching.batchnorm.deferred_copy`.

    Raises:
        ValueError: a batch-norm layer runs more than once per forward (the plain model
            updates its statistics once per call), or a training ``batch_norm`` call does
            not use one layer's own state.
    """
    rewriter = _Rewriter(model)
    result: OrderedDict[str, nn.Module] = OrderedDict()
    for name, layer in layers.items():
        if isinstance(layer, UnitModule):
            for key, graph in layer.graphs.items():
                if key != "eval":
                    rewriter.graph(graph)
            result[name] = layer
        else:
            rewriter._count(layer)
            result[name] = deferred_copy(layer, rewriter.cache)
    rewriter.check_calls()
    return result
