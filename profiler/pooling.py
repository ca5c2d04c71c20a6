"""Pools the timings of identical layers, so repeated blocks get one, less noisy, cost.

Deep models repeat one block many times (transformer layers, ResNet bottlenecks). Timed
one by one on a shared machine, identical blocks come out a few percent apart, and an
exact balancer then splits on noise. Layers with the same structure, parameters and
input shapes do the same work, so each gets the median of the group's measurements.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor, fx, nn

from profiler.profile import LayerProfile

__all__: list[str] = []


def _tensor_key(tensor: Tensor) -> str:
    grad = "g" if tensor.requires_grad else ""
    return f"{tuple(tensor.shape)}{tensor.dtype}{tensor.layout}{grad}"


def _graph_key(module: nn.Module) -> str:
    """A traced module's computation, wiring included, without its node names."""
    if not isinstance(module, fx.GraphModule):
        return ""
    index: dict[fx.Node, int] = {}
    steps = []
    for node in module.graph.nodes:
        index[node] = len(index)
        if node.op == "call_module":
            target = type(module.get_submodule(str(node.target))).__qualname__
        elif node.op in ("get_attr", "placeholder", "output"):
            target = ""
        else:
            target = getattr(node.target, "__qualname__", str(node.target))
        wiring = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        steps.append(f"{node.op}:{target}{wiring}")
    return ";".join(steps)


def layer_signature(layer: nn.Module, inputs: Sequence[Sequence[Tensor]]) -> str:
    """What decides a layer's cost: its modules, their modes, state shapes and its inputs.

    Args:
        layer: the layer.
        inputs: its input tensors at each profiled batch size.
    """
    # Positions, not names: unit modules keep their original paths (blocks.0, blocks.1).
    # A module whose repr names it says what matters for its cost in ``cost_repr()``.
    modules = ";".join(
        f"{type(m).__module__}.{type(m).__qualname__}"
        f"({getattr(m, 'cost_repr', m.extra_repr)()}){m.training}"
        f"{_graph_key(m)}"
        for m in layer.modules()
    )
    state = ";".join(_tensor_key(t) for t in (*layer.parameters(), *layer.buffers()))
    shapes = "|".join(",".join(_tensor_key(t) for t in x) for x in inputs)
    return f"{modules}#{state}#{shapes}"


def _median_lists(values: list[list[float]]) -> list[float]:
    return [statistics.median(column) for column in zip(*values, strict=True)]


def pool_identical(
    layers: Sequence[LayerProfile], signatures: Sequence[str]
) -> tuple[list[LayerProfile], list[list[str]]]:
    """Gives each group of layers with equal signatures the group's median times.

    Bytes are measured exactly and stay per layer; forward and backward seconds (and the
    CUDA transient peak, which also varies with the allocator's state) are pooled.

    Returns:
        The pooled profiles, and the names of each pooled group (two or more layers).
    """
    groups: dict[str, list[int]] = {}
    for index, signature in enumerate(signatures):
        groups.setdefault(signature, []).append(index)
    pooled = list(layers)
    names = []
    for members in groups.values():
        if len(members) < 2:
            continue
        group = [layers[i] for i in members]
        forward = _median_lists([p.forward for p in group])
        backward = _median_lists([p.backward for p in group])
        inputs = [p.backward_input for p in group]
        backward_input = None
        if all(i is not None for i in inputs):
            backward_input = _median_lists([list(i or []) for i in inputs])
        peaks = [p.peak for p in group]
        peak = None
        if all(p is not None for p in peaks):
            peak = [int(v) for v in _median_lists([[float(x) for x in p or []] for p in peaks])]
        for i in members:
            pooled[i] = replace(
                layers[i],
                forward=forward,
                backward=backward,
                peak=peak,
                backward_input=backward_input,
            )
        names.append([p.name for p in group])
    return pooled, names
