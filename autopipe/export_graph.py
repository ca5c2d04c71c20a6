"""torch.export (non-strict) with a dynamic batch dimension, and the graph it leaves."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Sequence

import torch
import torch.fx as fx
from torch import Tensor, nn

__all__ = ["check_symbolic_batch", "export_graph", "is_symbolic", "strip_checks"]

# Checks that export leaves in the graph; they pin shapes or devices a stage must not keep.
_DROPPED = {
    "aten::_assert_tensor_metadata",
    "aten::_assert_scalar",
    "aten::sym_constrain_range",
    "aten::sym_constrain_range_for_size",
}


def is_symbolic(size: object) -> bool:
    """Whether a traced size is a symbol rather than a constant (possibly wrapped)."""
    return isinstance(size, torch.SymInt) and bool(size.node.expr.free_symbols)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keeps a failing export from printing its partial graph and shape warnings.

    The failure itself is raised and reported; torch also prints the partial graph to
    stderr and logs symbolic-shape warnings, which would bury the one-line error.
    """
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    disabled = shapes.disabled
    shapes.disabled = True
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        shapes.disabled = disabled


def export_graph(module: nn.Module, tensors: tuple[Tensor, ...]) -> tuple[nn.Module, fx.Graph]:
    """Exports ``module(*tensors)`` with dim 0 of every input dynamic.

    Returns:
        The unlifted module, which holds the model's parameters and buffers (the same
        tensors) under plain containers next to the constants export lifted out of the
        code, and its graph.

    Raises:
        ValueError: export made the batch size a constant: the code depends on it.
        Exception: whatever torch.export raises when it cannot trace the module.
    """
    dims = tuple({0: torch.export.Dim.AUTO} for _ in tensors)
    with _quiet():
        program = torch.export.export(module, tensors, strict=False, dynamic_shapes=(dims,))
    unlifted = program.module()
    graph = unlifted.graph
    for node in graph.find_nodes(op="placeholder"):
        size = node.meta["val"].shape[0]
        if not is_symbolic(size):
            raise ValueError(
                f"torch.export made the batch size of input {node.name} the constant {size}: "
                "the model's code depends on the exact batch size (pass a sample with a "
                "batch of at least 2, and avoid reshapes with a hard-coded batch size)"
            )
    return unlifted, graph


def check_symbolic_batch(graph: fx.Graph, labels: Sequence[str]) -> None:
    """Checks that the graph's outputs have the inputs' symbolic batch size along dim 0.

    Raises:
        ValueError: an output (named by ``labels``) does not follow the batch.
    """
    first = graph.find_nodes(op="placeholder")[0].meta["val"].shape[0]
    (output,) = graph.find_nodes(op="output")
    for node, label in zip(output.args[0], labels):
        size = node.meta["val"].shape[0]
        if not is_symbolic(size) or size.node.expr != first.node.expr:
            raise ValueError(
                f"output {label} does not have the batch along dim 0 (its dim 0 is {size}, "
                f"the batch is {first}); wrap() needs batch-major outputs"
            )


def strip_checks(graph: fx.Graph) -> None:
    """Drops export's guard calls and metadata assertions, then dead size computations."""
    for node in reversed(graph.nodes):
        dropped = node.op == "call_module" and node.target == "_guards_fn"
        if isinstance(node.target, torch._ops.OpOverload):
            dropped = node.target._schema.name in _DROPPED
        if dropped and not node.users:
            graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op != "call_function" or _impure(n))


def _impure(node: fx.Node) -> bool:
    """Nodes kept even without users: all but side-effect free operators and getters."""
    if getattr(node.target, "__module__", "") == "_operator":
        return False
    return node.target not in (getattr, torch.ops.aten.sym_size.int)
