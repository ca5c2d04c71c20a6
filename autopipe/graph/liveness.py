"""Values live across each unit boundary: what a cut there sends, and whether it can be cut."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from autopipe.graph.units import Unit
from autopipe.graph.values import ValueInfo

__all__: list[str] = []  # internal to the package


@dataclass
class UnitIO:
    """What one unit needs and hands on.

    Attributes:
        nodes: the unit's own compute nodes, in graph order.
        inputs: the values live across the boundary before the unit (the model's tensor
            inputs for the first unit), which it receives in this order.
        outputs: the values live across the boundary after it (the model's flat tensor
            outputs for the last unit), which it returns in this order; values that only
            pass through are carried.
        attrs: the parameters, buffers and constants (``get_attr`` nodes) it reads itself.
        recompute: cheap non-tensor values of earlier units (sizes, dtypes...) it computes
            again instead of receiving them, in graph order.
        sizes: symbolic sizes (export graphs) it reads from an input's shape instead:
            ``node -> (input, dim)``.
        aliases: results of in-place updates of a parameter or buffer made by earlier
            units, which it reads from the attribute instead: ``node -> get_attr node``.
    """

    nodes: list[fx.Node]
    inputs: list[fx.Node] = field(default_factory=list)
    outputs: list[fx.Node] = field(default_factory=list)
    attrs: list[fx.Node] = field(default_factory=list)
    recompute: list[fx.Node] = field(default_factory=list)
    sizes: dict[fx.Node, tuple[fx.Node, int]] = field(default_factory=dict)
    aliases: dict[fx.Node, fx.Node] = field(default_factory=dict)


@dataclass
class Liveness:
    """The values crossing every unit boundary.

    Attributes:
        units: per-unit inputs, outputs and recomputed values.
        crossing: for boundary ``b`` (after unit ``b``), the values live across it.
        bytes: for each boundary, the bytes of its tensors at the traced batch size.
        invalid: boundaries that cannot be cut, with why: a non-tensor value crosses it (the
            executor only sends tensors between stages), or nothing does.
        flow: the graph of which unit defines (``unit -> value``) and needs
            (``value -> unit``) which value sent between units; units are the integer
            nodes, ``-1`` standing for the model's inputs.
    """

    units: list[UnitIO]
    crossing: list[list[fx.Node]]
    bytes: list[int]
    invalid: dict[int, str]
    flow: nx.DiGraph


def _symbolic(node: fx.Node) -> torch.SymInt | None:
    value = node.meta.get("val")
    return value if isinstance(value, torch.SymInt) else None


def _state_alias(node: fx.Node) -> fx.Node | None:
    """The ``get_attr`` node whose tensor ``node`` is, through in-place updates, if any."""
    while node.op != "get_attr":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            arguments = target._schema.arguments
            alias = arguments[0].alias_info if arguments else None
            in_place = alias is not None and alias.is_write
        else:
            name = target if isinstance(target, str) else getattr(target, "__name__", "")
            in_place = node.op != "call_module" and name.endswith("_") and not name.endswith("__")
        if not (in_place and node.args and isinstance(node.args[0], fx.Node)):
            return None
        node = node.args[0]
    return node


def _size_source(size: torch.SymInt, tensors: Sequence[fx.Node]) -> tuple[fx.Node, int] | None:
    """A tensor among ``tensors`` and a dimension of it whose size is ``size``."""
    for tensor in tensors:
        shape = getattr(tensor.meta.get("val"), "shape", None)
        for dim, extent in enumerate(shape or ()):
            if isinstance(extent, torch.SymInt) and extent.node.expr == size.node.expr:
                return tensor, dim
    return None


class _Requirements:
    """Collects what one unit needs from outside it."""

    def __init__(self, index: int, owner: Mapping[fx.Node, int], values: Mapping[str, ValueInfo]):
        self.index = index
        self.owner = owner
        self.values = values
        self.needs: dict[fx.Node, None] = {}
        self.attrs: dict[fx.Node, None] = {}
        self.recompute: dict[fx.Node, None] = {}
        self.sizes: dict[fx.Node, tuple[fx.Node, int]] = {}
        self.aliases: dict[fx.Node, fx.Node] = {}
        self.deferred: list[fx.Node] = []

    def cheap(self, node: fx.Node) -> bool:
        info = self.values.get(node.name)
        return (
            node.op in ("call_function", "call_method")
            and info is not None
            and info.kind == "simple"
        )

    def require(self, value: fx.Node) -> None:
        if value.op == "get_attr":
            self.attrs[value] = None
        elif self.owner.get(value) == self.index or value in self.recompute:
            return
        elif (state := _state_alias(value)) is not None:
            # The updated tensor is the attribute itself: read it here, never send it.
            self.attrs[state] = None
            self.aliases[value] = state
        elif self.cheap(value):
            if _symbolic(value) is not None:
                self.deferred.append(value)  # maybe readable from a tensor we receive anyway
            else:
                self.recompute_node(value)
        else:
            self.needs[value] = None

    def recompute_node(self, node: fx.Node) -> None:
        self.recompute[node] = None
        for arg in node.all_input_nodes:
            self.require(arg)

    def resolve(self) -> None:
        while self.deferred:
            size = self.deferred.pop(0)
            if size in self.recompute or size in self.sizes:
                continue
            tensors = [v for v in self.needs if self.values[v.name].kind == "tensor"]
            symbol = _symbolic(size)
            source = _size_source(symbol, tensors) if symbol is not None else None
            if source is not None:
                self.sizes[size] = source
            else:
                self.recompute_node(size)


def analyze(graph: fx.Graph, units: Sequence[Unit], values: Mapping[str, ValueInfo]) -> Liveness:
    """Finds the values live across each boundary between consecutive units.

    A unit receives everything live before it and returns everything live after it, so a
    value used several units later is carried through the units in between. Parameters
    and constants are read where they are used, never sent; cheap non-tensor values
    (sizes, dtypes) are recomputed where they are used, so only their tensor inputs are
    sent.

    Args:
        graph: the traced graph.
        units: its units, in order (see :func:`autopipe.graph.units.split_units`).
        values: what each node held on the sample, by node name.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    owner = {node: k for k, unit in enumerate(units) for node in unit.nodes}
    placeholders = list(graph.find_nodes(op="placeholder"))
    (output,) = graph.find_nodes(op="output")
    flow = nx.DiGraph()
    flow.add_nodes_from(range(len(units)))
    for value in placeholders:
        flow.add_edge(-1, value)
    found: list[_Requirements] = []
    for k, unit in enumerate(units):
        req = _Requirements(k, owner, values)
        for node in unit.nodes:
            flow.add_edge(k, node)
            for arg in node.all_input_nodes:
                req.require(arg)
        if k == len(units) - 1:
            for arg in output.all_input_nodes:
                req.require(arg)
        req.resolve()
        flow.add_edges_from((value, k) for value in req.needs)
        found.append(req)
    live: list[list[fx.Node]] = [[] for _ in range(len(units) - 1)]
    for value in sorted((v for v in flow if isinstance(v, fx.Node)), key=order.__getitem__):
        users = list(flow.successors(value))
        if not users:
            continue
        (start,) = flow.predecessors(value)
        for b in range(start, max(users)):
            if b >= 0:
                live[b].append(value)
    invalid: dict[int, str] = {}
    sizes = []
    for b, crossing in enumerate(live):
        others = [v.name for v in crossing if values[v.name].kind != "tensor"]
        if others:
            kinds = ", ".join(f"{n} ({values[n].type_name})" for n in others)
            invalid[b] = f"non-tensor values cross it: {kinds}"
        elif not crossing:
            invalid[b] = "no tensor crosses it"
        sizes.append(sum(values[v.name].nbytes for v in crossing))
    results = []
    for k, (unit, req) in enumerate(zip(units, found)):
        inputs = placeholders if k == 0 else live[k - 1]
        outputs = list(output.args[0]) if k == len(units) - 1 else live[k]
        results.append(
            UnitIO(
                nodes=list(unit.nodes),
                inputs=list(inputs),
                outputs=outputs,
                attrs=sorted(req.attrs, key=order.__getitem__),
                recompute=sorted(req.recompute, key=order.__getitem__),
                sizes=dict(req.sizes),
                aliases=dict(req.aliases),
            )
        )
    return Liveness(results, live, sizes, invalid, flow)
