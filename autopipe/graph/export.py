"""torch.export (non-strict) with a dynamic batch dimension, and the graph it leaves."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.shapes import InputShapes

__all__: list[str] = []  # internal to the package

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


def export_graph(
    module: nn.Module,
    tensors: tuple[Tensor, ...],
    dynamic: Sequence[Mapping[int, Any]] | None = None,
    names: Sequence[tuple[str | int, str]] | None = None,
) -> tuple[nn.Module, fx.Graph, InputShapes]:
    """Exports ``module(*tensors)`` with dim 0 of every input dynamic.

    Args:
        module: the module, called on the flat tensors.
        tensors: the sample.
        dynamic: for each tensor, further dims to keep symbolic (dim -> ``torch.export.Dim``
            or ``Dim.AUTO``); every other size is fixed at the sample's.
        names: each tensor's key and readable name (see
            :func:`autopipe.graph.shapes.input_names`), for the messages.

    Returns:
        The unlifted module, which holds the model's parameters and buffers (the same
        tensors) under plain containers next to the constants export lifted out of the
        code, its graph, and what the graph assumes of its inputs.

    Raises:
        ValueError: export made the batch size, or a dim declared dynamic, a constant: the
            code depends on it.
        Exception: whatever torch.export raises when it cannot trace the module.
    """
    extra = list(dynamic or [{} for _ in tensors])
    dims = tuple({0: torch.export.Dim.AUTO, **more} for more in extra)
    with _quiet():
        program = torch.export.export(module, tensors, strict=False, dynamic_shapes=(dims,))
    unlifted = program.module()
    graph = unlifted.graph
    placeholders = graph.find_nodes(op="placeholder")
    labels = [name for _, name in names] if names else [n.name for n in placeholders]
    for node, label, more in zip(placeholders, labels, extra):
        shape = node.meta["val"].shape
        if not is_symbolic(shape[0]):
            raise ValueError(
                f"torch.export made the batch size of input {label} the constant {shape[0]}: "
                "the model's code depends on the exact batch size (pass a sample with a "
                "batch of at least 2, and avoid reshapes with a hard-coded batch size)"
            )
        for dim in sorted(more):
            if not is_symbolic(shape[dim]):
                raise ValueError(
                    f"dim {dim} of input {label} was declared dynamic, but torch.export fixed "
                    f"it at {shape[dim]}: the model's code needs that exact size (a reshape "
                    "or a table of that size); leave it out of dynamic="
                )
    named = list(names) if names else [(n.name, n.name) for n in placeholders]
    return unlifted, graph, _input_shapes(program, unlifted, tensors, named)


def _bound(value: Any) -> int | None:
    """A range end as an int, ``None`` when infinite (torch's ``int_oo`` claims to be finite)."""
    try:
        return int(value)
    except (TypeError, ValueError, AttributeError):
        return None


def _input_shapes(
    program: torch.export.ExportedProgram,
    unlifted: nn.Module,
    tensors: tuple[Tensor, ...],
    names: list[tuple[str | int, str]],
) -> InputShapes:
    """What the exported graph assumes of its inputs, read before its checks are dropped."""
    graph = unlifted.graph
    assert isinstance(graph, fx.Graph)
    placeholders = list(graph.find_nodes(op="placeholder"))
    values = [node.meta["val"] for node in placeholders]
    dims = [
        tuple(s.node.expr if is_symbolic(s) else int(s) for s in value.shape) for value in values
    ]
    batch = dims[0][0] if dims else None
    ranges = {
        symbol: (int(r.lower), _bound(r.upper))
        for symbol, r in program.range_constraints.items()
        if symbol != batch
    }
    # Export's guard function checks what the code branched on; strip_checks drops its
    # call from the graph (a stage sees other inputs), so the wrapper calls it instead.
    calls = list(graph.find_nodes(op="call_module", target="_guards_fn"))
    guards = unlifted.get_submodule("_guards_fn") if calls else None
    return InputShapes(
        names=names,
        sample=[tuple(t.shape) for t in tensors],
        dims=dims,
        dtypes=[value.dtype for value in values],
        batch=batch,
        ranges=ranges,
        guards=guards,
        guard_inputs=[placeholders.index(a) for a in calls[0].args] if calls else [],
        placeholders=[node.name for node in placeholders],
    )


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


def drop_constant_copies(graph: fx.Graph) -> None:
    """Reads the constants export lifted out of the code in place of their fresh copies.

    ``torch.tensor([-2])`` in a forward (Falcon's key and value columns) becomes a lifted
    constant and ``lift_fresh_copy`` of it; an indexing op then saves the copy for backward,
    a storage per call that the same trace on the meta device does not make (it reads the
    constant). Where no user writes the copy or returns a view of it, the constant itself
    gives the same values, and the real and the meta-device model save the same bytes.
    """
    copy = torch.ops.aten.lift_fresh_copy.default
    for node in list(graph.find_nodes(op="call_function", target=copy)):
        (source,) = node.args
        if not isinstance(source, fx.Node) or source.op != "get_attr":
            continue
        if all(_reads_only(user, node) for user in node.users):
            node.replace_all_uses_with(source)
            graph.erase_node(node)


def _reads_only(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user`` is an operator that neither writes ``value`` nor returns a view of it."""
    if not isinstance(user.target, torch._ops.OpOverload):
        return False
    schema = user.target._schema
    if any(r.alias_info is not None for r in schema.returns):
        return False  # a view (or an in-place result) of an argument
    given = list(zip(schema.arguments, user.args))
    given += [(arg, user.kwargs[arg.name]) for arg in schema.arguments if arg.name in user.kwargs]
    return all(
        arg.alias_info is None or not arg.alias_info.is_write
        for arg, passed in given
        if passed is value or (isinstance(passed, (list, tuple)) and value in passed)
    )


def _impure(node: fx.Node) -> bool:
    """Nodes kept even without users: all but side-effect free operators and getters."""
    if getattr(node.target, "__module__", "") == "_operator":
        return False
    return node.target not in (getattr, torch.ops.aten.sym_size.int)
