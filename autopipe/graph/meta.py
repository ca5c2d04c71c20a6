"""Tracing models whose tensors are (all or partly) on the meta device: no storage, no values."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import Tensor, nn

__all__ = ["has_meta_state", "rebind_state"]

META = torch.device("meta")

# What torch says when code needs the values a meta tensor does not have, and the construct.
_CONSTRUCTS = (
    ("Tensor.item() cannot be called on meta tensors", "Tensor.item() (or a tensor in an if)"),
    ("torch.nonzero()", "torch.nonzero (or indexing with a boolean mask)"),
    ("Cannot copy out of meta tensor", "reading a tensor's values (.tolist(), .cpu(), .numpy())"),
    ("with Meta tensors", "an operator without a meta kernel"),
    ("a meta tensor without output_size", "repeat_interleave without output_size"),
)


def has_meta_state(model: nn.Module) -> bool:
    """Whether any parameter or buffer of the model is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def meta_construct(exc: BaseException) -> str | None:
    """The data-dependent construct that made ``exc`` on meta tensors, ``None`` for others."""
    seen: BaseException | None = exc
    while seen is not None:  # torch.export wraps the original error
        text = str(seen)
        for needle, construct in _CONSTRUCTS:
            if needle in text:
                return construct
        seen = seen.__cause__ or seen.__context__
    return None


@contextlib.contextmanager
def meta_shadow(model: nn.Module) -> Iterator[None]:
    """Replaces the model's real parameters and buffers by meta ones for the block.

    A model only partly on meta is traced all on meta (real and meta tensors cannot meet
    in one operator); tied tensors stay one. The real tensors are put back afterwards:
    graphs traced inside hold the meta stand-ins until :func:`rebind_state`.
    """
    made: dict[int, Tensor] = {}
    saved: list[tuple[dict[str, Tensor | None], str, Tensor]] = []
    for sub in model.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in made:
                    shadow = torch.empty_like(tensor, device=META)
                    if isinstance(tensor, nn.Parameter):
                        shadow = nn.Parameter(shadow, requires_grad=tensor.requires_grad)
                    made[id(tensor)] = shadow
                saved.append((table, name, tensor))  # type: ignore[arg-type]
                table[name] = made[id(tensor)]  # type: ignore[assignment]
    try:
        yield
    finally:
        for table, name, tensor in saved:
            table[name] = tensor


def _lookup(model: nn.Module, path: str) -> object:
    owner, _, field = path.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, field)


def rebind_state(module: nn.Module, model: nn.Module, prefix: str = "model") -> int:
    """Points every graph of ``module`` at the model's current parameters and buffers.

    A graph module holds the tensors its ``get_attr`` nodes read (``model.<name>``) in
    containers of its own, not through the model's submodules; replacing a tensor of the
    model (materializing a meta one creates a new ``Parameter``) leaves the graph reading
    the old one. Modules the graph calls are the model's own and follow by themselves.

    Args:
        module: a graph module, or a module holding graph modules (units, stages).
        model: the model the graphs were traced from.
        prefix: the name the traced root holds the model under.

    Returns:
        How many references were replaced.
    """
    replaced = 0
    for graph_module in module.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.find_nodes(op="get_attr"):
            target = str(node.target)
            if not target.startswith(prefix + "."):
                continue
            try:
                current = _lookup(model, target[len(prefix) + 1 :])
                parent, _, field = target.rpartition(".")
                holder = graph_module.get_submodule(parent)
            except AttributeError:
                continue
            if not isinstance(current, Tensor) or getattr(holder, field, None) is current:
                continue
            if field in holder._parameters and isinstance(current, nn.Parameter):
                holder._parameters[field] = current
            elif field in holder._buffers:
                holder._buffers[field] = current
            else:
                object.__setattr__(holder, field, current)
            replaced += 1
    return replaced
