"""Tracing a deep stack of identical blocks once: export a few, repeat their graph.

torch.export's time grows with the operations it records, so a model of 61 decoder blocks
costs 61 blocks' tracing although every block past the first few records the same
operations on its own weights. When a model holds a long ``nn.ModuleList`` whose blocks
from some index on are alike (same class, parameter and buffer shapes, and every other
attribute but their own index), the model is exported with the list cut after three of
the alike blocks, and the third one's nodes are copied for each later block: its weights
read from that block's, its carried inputs (the hidden state) taken from the copy before,
everything else it reads (masks, rotary tables) shared. The last two traced blocks must
record the same operations (the third the image of the second), or the model is exported
whole; so must the graph's tail read nothing of the blocks but the last one's outputs.

Blocks that differ only in code reading their own index (``if self.layer_idx in ...``)
look alike here; Hugging Face's models set such differences as attributes when built
(``attention_type``, ``sliding_window``), which tell them apart. A model with real
tensors is checked whole against its own outputs (:mod:`autopipe.graph.trace_checks`),
which would show such a difference; a meta model's checks compare shapes only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.meta import model_attribute

__all__: list[str] = []

# Fewer blocks than this are exported whole: cutting saves little.
MIN_BLOCKS = 8


@dataclass(frozen=True)
class Repeats:
    """A list of blocks alike from ``first`` on.

    Attributes:
        path: the list's name in the model (``model.layers``).
        count: its blocks.
        first: the index of the first of the alike blocks that end the list.
    """

    path: str
    count: int
    first: int

    @property
    def kept(self) -> int:
        """Blocks the cut model keeps: up to three alike ones (the first of a kind may
        differ from the rest, e.g. in what it converts of its input; the last two are
        compared)."""
        return self.first + 3


def _names_index(field: str) -> bool:
    """Whether an attribute's name says it holds its block's index (``layer_idx``,
    ``layer_number``, ``block_id``)."""
    lowered = field.lower()
    return any(word in lowered for word in ("idx", "index", "layer", "number", "_id"))


def _key(block: nn.Module, index: int) -> tuple[Any, ...]:
    """What makes two blocks trace alike: their modules' classes, state shapes and other
    attributes, a block's own index left out."""
    parts: list[Any] = []
    for name, module in block.named_modules():
        attributes: list[tuple[str, Any]] = []
        for field, value in sorted(vars(module).items()):
            if field.startswith("_") or field == "training":
                continue
            if isinstance(value, (bool, int, float, str, type(None))):
                if value == index and _names_index(field) and not isinstance(value, bool):
                    continue
                attributes.append((field, value))
            elif isinstance(value, (tuple, list)) and all(
                isinstance(v, (bool, int, float, str)) for v in value
            ):
                attributes.append((field, tuple(value)))
        parts.append((name, type(module).__qualname__, module.training, tuple(attributes)))
    for name, tensor in (*block.named_parameters(), *block.named_buffers()):
        parts.append((name, tuple(tensor.shape), str(tensor.dtype), tensor.requires_grad))
    return tuple(parts)


def find_repeats(model: nn.Module) -> Repeats | None:
    """The model's longest list of at least :data:`MIN_BLOCKS` blocks whose alike tail
    runs three or more blocks past the three traced, or ``None``."""
    best: Repeats | None = None
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_BLOCKS:
            continue
        keys = [_key(block, i) for i, block in enumerate(module)]
        first = len(keys) - 1
        while first > 0 and keys[first - 1] == keys[-1]:
            first -= 1
        found = Repeats(path, len(keys), first)
        if found.count - found.kept >= 3 and (best is None or found.count > best.count):
            best = found
    return best


@contextlib.contextmanager
def cut(model: nn.Module, repeats: Repeats) -> Iterator[None]:
    """The model with its list cut to :attr:`Repeats.kept` blocks, then restored."""
    parent_path, _, name = repeats.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    whole = getattr(parent, name)
    parent._modules[name] = nn.ModuleList(list(whole)[: repeats.kept])
    try:
        yield
    finally:
        parent._modules[name] = whole


def _stack_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _in_block(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _renamed(text: str, old: str, new: str) -> str:
    """``text`` with the block path ``old`` (at a dot boundary) replaced by ``new``."""
    if text == old:
        return new
    return text.replace(old + ".", new + ".")


def _blocks(
    graph: fx.Graph, base: str, repeats: Repeats
) -> tuple[list[fx.Node], list[fx.Node]] | None:
    """The nodes of the last two traced blocks, contiguous and adjacent, or ``None``."""
    nodes = list(graph.nodes)
    found = []
    for index in (repeats.kept - 2, repeats.kept - 1):
        at = [i for i, n in enumerate(nodes) if _in_block(_stack_path(n), f"{base}.{index}")]
        if not at or at[-1] - at[0] + 1 != len(at):
            return None
        found.append([nodes[i] for i in at])
    one, two = found
    if nodes.index(two[0]) != nodes.index(one[-1]) + 1:
        return None
    if any(n.op not in ("call_function", "call_method") for n in two):
        return None
    return one, two


def _leaves(node: fx.Node) -> list[Any]:
    """The leaves of a node's arguments, in order."""
    found: list[Any] = []

    def keep(value: Any) -> Any:
        found.append(value)
        return value

    fx.node.map_aggregate((node.args, node.kwargs), keep)
    return found


def _carried(one: list[fx.Node], two: list[fx.Node], old: str, new: str) -> bool:
    """Whether ``two`` records what ``one`` does, each node the image of its own, its
    weights the image of the first's, and what it reads of the first block standing
    where the first read the same node from before it (one node for one)."""
    if len(one) != len(two):
        return False
    image = dict(zip(one, two, strict=True))
    carried: dict[fx.Node, fx.Node] = {}
    inside = set(one)
    for a, b in zip(one, two, strict=True):
        if (a.op, a.target) != (b.op, b.target):
            return False
        wanted, got = _leaves(a), _leaves(b)
        if len(wanted) != len(got):
            return False
        for w, g in zip(wanted, got, strict=True):
            if not isinstance(w, fx.Node):
                if isinstance(g, fx.Node) or repr(w) != repr(g):
                    return False
            elif w in image:
                if g is not image[w]:
                    return False
            elif w.op == "get_attr":
                if not isinstance(g, fx.Node) or g.op != "get_attr":
                    return False
                if str(g.target) != _renamed(str(w.target), old, new):
                    return False
            elif g is not w:
                # Read from before both blocks: the same node (shared), or the first
                # block's node standing for it (carried, the same one every time).
                if not isinstance(g, fx.Node) or g not in inside or carried.get(w, g) is not g:
                    return False
                carried[w] = g
    return True


def _attr(root: nn.Module, model: nn.Module, target: str, prefix: str) -> None:
    """Gives ``root`` the tensor ``target`` (``<prefix>.<name in model>``), the model's own."""
    holder_path, _, field = target.rpartition(".")
    holder = root
    for part in holder_path.split("."):
        if part not in holder._modules:
            holder._modules[part] = nn.Module()
        holder = holder._modules[part]  # type: ignore[assignment]
    value = model_attribute(model, target[len(prefix) + 1 :])
    if not isinstance(value, Tensor):
        raise AttributeError(f"{target} is not a tensor")
    if isinstance(value, nn.Parameter):
        holder._parameters[field] = value
    else:
        holder._buffers[field] = value


class _Copies:
    """Where a copy of the last traced block takes each of its inputs."""

    def __init__(
        self, graph: fx.Graph, root: nn.Module, model: nn.Module, prefix: str, second: str
    ) -> None:
        self.graph, self.root, self.model, self.prefix = graph, root, model, prefix
        self.second = second  # the last traced block's path in the graph
        self.block = second  # the path of the block being copied to
        self.made: dict[fx.Node, fx.Node] = {}  # the last block's node -> its copy
        self.previous: dict[fx.Node, fx.Node] = {}  # one block's node -> its latest image
        self.attrs = {str(n.target): n for n in graph.find_nodes(op="get_attr")}

    def source(self, value: fx.Node) -> fx.Node:
        if value in self.made:
            return self.made[value]
        if value in self.previous:
            return self.previous[value]
        if value.op == "get_attr" and _in_block(str(value.target), self.second):
            target = _renamed(str(value.target), self.second, self.block)
            if target not in self.attrs:
                _attr(self.root, self.model, target, self.prefix)
                with self.graph.inserting_after(value):
                    made = self.graph.get_attr(target)
                made.meta = dict(value.meta)
                self.attrs[target] = made
            return self.attrs[target]
        return value


def extend(
    graph: fx.Graph, root: nn.Module, model: nn.Module, repeats: Repeats, prefix: str
) -> bool:
    """Extends ``graph`` (traced from the model cut to :attr:`Repeats.kept` blocks) to the
    whole list, in place; ``False`` (and the graph unchanged) where the traced blocks do
    not repeat as described in the module docstring.

    Args:
        graph: the cut model's graph.
        root: the module its ``get_attr`` targets resolve in; it gets the later blocks'.
        model: the whole model (its list restored).
        repeats: the list.
        prefix: the name ``root`` holds the model under.
    """
    base = f"{prefix}.{repeats.path}"
    found = _blocks(graph, base, repeats)
    if found is None:
        return False
    one, two = found
    old, new = f"{base}.{repeats.kept - 2}", f"{base}.{repeats.kept - 1}"
    if not _carried(one, two, old, new):
        return False
    nodes = list(graph.nodes)
    after = nodes[nodes.index(two[-1]) + 1 :]
    # The tail may read the last block's nodes, and nothing of the earlier ones.
    earlier = set(one)
    if any(arg in earlier for node in after for arg in node.all_input_nodes):
        return False
    copies = _Copies(graph, root, model, prefix, new)
    copies.previous = dict(zip(one, two, strict=True))
    counterpart = dict(copies.previous)
    insert_at, last = two[-1], two
    for index in range(repeats.kept, repeats.count):
        copies.block, copies.made = f"{base}.{index}", {}
        for node in two:
            with graph.inserting_after(insert_at):
                copied = graph.node_copy(node, copies.source)
            copied.meta = dict(node.meta)
            stack = node.meta.get("nn_module_stack")
            if stack:
                copied.meta["nn_module_stack"] = {
                    key: (_renamed(str(path), new, copies.block), kind)
                    for key, (path, kind) in stack.items()
                }
            copies.made[node] = insert_at = copied
        # The next copy reads this one's nodes where the last block read the one before.
        copies.previous = {first: copies.made[second] for first, second in counterpart.items()}
        last = [copies.made[n] for n in two]
    image = dict(zip(two, last, strict=True))
    for node in after:
        node.args = fx.node.map_arg(node.args, lambda v: image.get(v, v))
        node.kwargs = fx.node.map_arg(node.kwargs, lambda v: image.get(v, v))
    return True
