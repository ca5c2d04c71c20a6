"""Grouping the nodes of a traced graph into units along module-call boundaries."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from autopipe.graph.tracing import PREFIX
from autopipe.graph.values import ValueInfo

__all__ = ["GRANULARITIES"]

GRANULARITIES = ("children", "blocks", "leaves")
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_SKIPPED = ("placeholder", "get_attr", "output")


@dataclass
class Unit:
    """Consecutive nodes of the graph that run as one layer of the pipeline.

    Attributes:
        labels: the module calls the unit holds, in order (``blocks.0``; ``shared#2`` for
            the second call of a module); code between module calls joins the next call.
        nodes: the unit's compute nodes in graph order; placeholders, attributes
            (``get_attr``) and the output are not assigned to units.
    """

    labels: list[str]
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The unit's name: its module calls joined by ``+``."""
        return "+".join(self.labels)


def _repeats_blocks(module: nn.Module) -> bool:
    """Whether a container inside ``module`` (or itself) repeats a block: two children of one
    class that have children of their own."""
    for sub in module.modules():
        if isinstance(sub, _CONTAINERS):
            kinds = Counter(type(c) for c in sub.children() if any(True for _ in c.children()))
            if any(n >= 2 for n in kinds.values()):
                return True
    return False


def unit_paths(model: nn.Module, granularity: str = "blocks") -> set[str]:
    """The qualified names of the modules whose calls become units.

    ``children``: the model's direct children. ``leaves``: modules without children.
    ``blocks``: the model is opened up from the top; a module is opened (its children
    considered instead) when it is a container (``ModuleList``, ``ModuleDict``,
    ``Sequential``) or when it holds repeated blocks somewhere inside, e.g. the layers of a
    transformer; the modules reached that are not opened are the units.

    Raises:
        ValueError: unknown granularity.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity == "children":
        return {name for name, _ in model.named_children()}
    if granularity == "leaves":
        return {name for name, m in model.named_modules() if name and not any(m.children())}
    paths: set[str] = set()
    stack = [(name, child) for name, child in model.named_children()]
    while stack:
        name, module = stack.pop()
        if isinstance(module, _CONTAINERS) or _repeats_blocks(module):
            stack.extend((f"{name}.{n}", c) for n, c in module.named_children())
        else:
            paths.add(name)
    return paths


def _strip(path: str) -> str | None:
    """A traced module path relative to the model, or ``None`` outside it."""
    path = path.split("@")[0]  # export marks repeated calls as ``name@2``
    if path == PREFIX:
        return ""
    if path.startswith(PREFIX + "."):
        return path[len(PREFIX) + 1 :]
    return None


def module_path(node: fx.Node) -> str:
    """The qualified name of the innermost module whose code made ``node`` (``""``: the
    model's own ``forward``)."""
    if node.op == "call_module":
        return _strip(str(node.target)) or ""
    stack = node.meta.get("nn_module_stack") or {}
    for value in reversed(list(stack.values())):
        path = _strip(str(value[0]))
        if path is not None:
            return path
    return ""


def _prefixes(path: str) -> list[str]:
    """``a``, ``a.b``, ``a.b.c`` for ``a.b.c``; none for the model itself."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _silent(compute: Sequence[fx.Node], paths: set[str]) -> set[str]:
    """Modules whose code runs in the graph while none of the unit modules inside them is
    ever called (``nn.MultiheadAttention`` reads its ``out_proj`` weights without calling
    it); their code is a unit of its own rather than glue of the next call."""
    own = {module_path(node) for node in compute}
    seen = {prefix for path in own for prefix in _prefixes(path)}
    silent: set[str] = set()
    for path in own - paths - {""}:
        inside = [p for p in paths if p.startswith(path + ".")]
        if inside and not any(p in seen for p in inside):
            silent.add(path)
    return silent


def _key(node: fx.Node, paths: set[str], silent: set[str]) -> str | None:
    path = module_path(node)
    for prefix in _prefixes(path):  # outermost first
        if prefix in paths or prefix in silent:
            return prefix
    # A module called as one opaque node that would have been opened up is a unit itself.
    return path if node.op == "call_module" and path else None


def _unpacks(node: fx.Node, values: Mapping[str, ValueInfo]) -> fx.Node | None:
    """The structure ``node`` takes a part of, when it is pure unpacking: ``out[0]`` or
    ``out.last_hidden_state`` with a constant key, on a tuple, list, dict or dataclass."""
    if node.op != "call_function" or node.target not in (operator.getitem, getattr):
        return None
    if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], fx.Node):
        return None
    source = node.args[0]
    # A key computed in the graph (``out[i]``) may come from a later unit than ``out``.
    if node.all_input_nodes != [source]:
        return None
    info = values.get(source.name)
    return source if info is not None and info.kind == "other" else None


def split_units(graph: fx.Graph, paths: set[str], values: Mapping[str, ValueInfo]) -> list[Unit]:
    """Splits the graph's compute nodes into one unit per module call (see :class:`Unit`).

    Unpacking a module's tuple, dict or dataclass result (``out, state = lstm(x)``) joins
    the unit that made it, wherever the graph does it, so that a cut after the module sends
    the tensors used later rather than the structure, which cannot cross. A module whose
    code runs while none of the unit modules inside it is called is a unit itself.

    Args:
        graph: the traced graph, whose nodes carry ``nn_module_stack`` metadata.
        paths: the modules whose calls are units (see :func:`unit_paths`).
        values: what each node held on the sample, by node name.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    units: list[Unit] = []
    keys: list[str] = []
    owner: dict[fx.Node, int] = {}
    calls: Counter[str] = Counter()
    pending: list[fx.Node] = []

    def close(unit: int, nodes: list[fx.Node]) -> None:
        units[unit].nodes.extend(nodes)
        owner.update((n, unit) for n in nodes)

    compute = [node for node in graph.nodes if node.op not in _SKIPPED]
    silent = _silent(compute, paths)
    for node in compute:
        key = _key(node, paths, silent)
        # fx records ``out.attr`` where it is first used, in the next module's code.
        source = _unpacks(node, values)
        if source is not None and source in owner:
            close(owner[source], [node])
        elif key is None:
            pending.append(node)
        elif keys and keys[-1] == key:
            close(len(units) - 1, [*pending, node])
            pending = []
        else:
            calls[key] += 1
            label = key if calls[key] == 1 else f"{key}#{calls[key]}"
            units.append(Unit([label or "forward"]))
            keys.append(key)
            close(len(units) - 1, [*pending, node])
            pending = []
    if pending:
        if not units:
            units.append(Unit(["forward"]))
        close(len(units) - 1, pending)
    for unit in units:
        unit.nodes.sort(key=order.__getitem__)
    return units


def merge_units(units: Sequence[Unit], boundaries: Iterable[int]) -> list[Unit]:
    """Merges unit ``b`` with unit ``b + 1`` for each boundary ``b``."""
    joined = set(boundaries)
    merged: list[Unit] = []
    for i, unit in enumerate(units):
        if merged and i - 1 in joined:
            merged[-1] = Unit(merged[-1].labels + unit.labels, merged[-1].nodes + unit.nodes)
        else:
            merged.append(Unit(list(unit.labels), list(unit.nodes)))
    return merged


def regroup(runs: Sequence[Unit], layout: Sequence[Unit]) -> list[Unit]:
    """Groups the units of another trace of the model like ``layout``.

    Each unit of ``runs`` (one module call, from :func:`split_units`) goes to the ``layout``
    unit holding its label; calls that ``layout`` does not know join the next known one.

    Raises:
        ValueError: the calls come in an order that ``layout`` cannot follow.
    """
    where = {label: i for i, unit in enumerate(layout) for label in unit.labels}
    grouped = [Unit(list(unit.labels)) for unit in layout]
    pending: list[fx.Node] = []
    current = 0
    for run in runs:
        index = where.get(run.labels[0])
        if index is None:
            pending.extend(run.nodes)
            continue
        if index < current:
            raise ValueError(
                f"module call {run.labels[0]} comes after unit {layout[current].name} in this "
                "mode's graph but before it in the other's; the modes cannot share one split"
            )
        current = index
        grouped[index].nodes.extend([*pending, *run.nodes])
        pending = []
    grouped[-1].nodes.extend(pending)
    return grouped
