"""What re-computing a layer's normalizations in the backward frees and costs.

Megatron-LM's ``--recompute-granularity selective --recompute-modules layernorm`` (and
DeepSeek-V3's training, which re-computes every RMSNorm) keeps no normalization's output
for the backward: the operation that saved it (the next projection) gets it again by
running the normalization once more from its input, which the normalization's own backward
keeps anyway. Counted in the layer's counting forward:

- the bytes of the layer's saved tensors that are outputs of its normalization modules
  (each storage once): what that re-computation frees per micro-batch;
- the forward work of those modules (FLOPs, memory traffic, operations): what the backward
  runs again.

A normalization module is one whose class name ends in ``LayerNorm`` or ``RMSNorm``
(torch's, Hugging Face's and fused ones alike); a normalization inside another counts with
the outer one. In a traced unit (an fx graph) the modules are gone: the nodes each
normalization left (``nn_module_stack``) are found and marked on the counting copy, so the
same figures come out. Norm outputs cast by autocast before the next operation saves them
are copies made outside the module and are not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch.fx as fx
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from profiler.storages import storage_key

__all__: list[str] = []

NORM_SUFFIXES = ("LayerNorm", "RMSNorm")


def is_norm(module: nn.Module) -> bool:
    """Whether the module is a normalization whose output re-computation may drop."""
    return type(module).__name__.endswith(NORM_SUFFIXES)


# The watch the marks of a traced graph report to, while one is watching.
_ACTIVE: list[NormWatch] = []


def norm_entered(region: str, *inputs: Any) -> None:
    """A marked graph enters a normalization's nodes, with the values they read."""
    if _ACTIVE:
        _ACTIVE[-1].enter(inputs)


def norm_left(region: str, *outputs: Any) -> None:
    """A marked graph leaves a normalization's nodes, with the values it passes on."""
    if _ACTIVE:
        _ACTIVE[-1].leave(outputs)


def _norm_path(node: fx.Node) -> str | None:
    """The outermost normalization module a node was traced in, by its path."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, kind in stack.values():
        name = kind.__name__ if isinstance(kind, type) else str(kind).rsplit(".", 1)[-1]
        if name.endswith(NORM_SUFFIXES):
            return str(path)
    return None


def mark_norms(module: fx.GraphModule) -> int:
    """Marks each normalization's nodes in the graph (in place): a call before the first
    and one after the last, with the values its nodes pass to the rest. Returns how many."""
    return mark_regions(module, _norm_path, norm_entered, norm_left)


def mark_regions(
    module: fx.GraphModule,
    path_of: Callable[[fx.Node], str | None],
    entered: Callable[..., None],
    left: Callable[..., None],
) -> int:
    """Marks the nodes each module call left in the graph (in place), the modules those
    of ``path_of`` (a node's module path, ``None`` outside them): ``entered`` before the
    first node with the path and the values they read, ``left`` after the last with the
    values they pass on. Returns how many calls."""
    graph = module.graph
    # One region per call: a run of consecutive operations in one module (a module called
    # twice leaves two runs, each its own output and work).
    regions: list[tuple[str, list[fx.Node]]] = []
    last: str | None = None
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            if node.target in (entered, left):
                return 0  # marked already
            path = path_of(node)
            if path is not None and path == last:
                regions[-1][1].append(node)
            elif path is not None:
                regions.append((path, [node]))
            last = path
    for path, nodes in regions:
        inside = set(nodes)
        passed = [n for n in nodes if any(user not in inside for user in n.users)]
        read = {a: None for n in nodes for a in n.all_input_nodes if a not in inside}
        with graph.inserting_before(nodes[0]):
            graph.call_function(entered, (path, *read))
        with graph.inserting_after(nodes[-1]):
            graph.call_function(left, (path, *passed))
    if regions:
        module.recompile()
    return len(regions)


@contextmanager
def hooked(
    modules: list[nn.Module], before: Callable[..., Any], after: Callable[..., Any]
) -> Iterator[None]:
    """``before`` as a forward pre-hook and ``after`` as a forward hook of each module,
    while inside."""
    handles = [m.register_forward_pre_hook(before) for m in modules]
    handles += [m.register_forward_hook(after) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Work(NamedTuple):
    """FLOPs, bytes moved and operations run so far in a pass."""

    flops: float
    traffic: float
    operations: int


class NormWatch:
    """Records, during one forward, the normalization modules' outputs and their work.

    Args:
        layer: the layer whose normalization modules are watched.
        totals: the pass's work counted so far (read before and after each module).
    """

    def __init__(self, layer: nn.Module, totals: Callable[[], Work]) -> None:
        self.norms = [m for m in layer.modules() if is_norm(m)]
        for module in layer.modules():
            if isinstance(module, fx.GraphModule):
                mark_norms(module)
        self.totals = totals
        self.outputs: set[int] = set()
        self.flops = 0.0
        self.traffic = 0.0
        self.operations = 0
        self._depth = 0
        self._start = Work(0.0, 0.0, 0)
        self._read: set[int] = set()

    def _before(self, module: nn.Module, args: Any) -> None:
        self.enter(args)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:
        self.leave(output)

    def enter(self, inputs: Any) -> None:
        if self._depth == 0:
            self._start = self.totals()
            # What the norm returns of its own input (a cast to its dtype already, which
            # a trace may pass on in the input's place) is no output of its.
            self._read = {storage_key(t)[0] for t in tree_leaves(inputs) if isinstance(t, Tensor)}
        self._depth += 1

    def leave(self, output: Any) -> None:
        self._depth -= 1
        if self._depth:
            return
        now = self.totals()
        self.flops += now.flops - self._start.flops
        self.traffic += now.traffic - self._start.traffic
        self.operations += now.operations - self._start.operations
        for leaf in tree_leaves(output):
            if isinstance(leaf, Tensor) and storage_key(leaf)[0] not in self._read:
                self.outputs.add(storage_key(leaf)[0])

    @contextmanager
    def watching(self) -> Iterator[NormWatch]:
        _ACTIVE.append(self)
        try:
            with hooked(self.norms, self._before, self._after):
                yield self
        finally:
            _ACTIVE.remove(self)

    def saved_outputs(self, saved: list[Tensor]) -> list[Tensor]:
        """Of the tensors the forward saved, those that are a normalization's output."""
        return [t for t in saved if storage_key(t)[0] in self.outputs]
