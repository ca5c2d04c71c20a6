"""Outputs that are not one row per sample, made batch-major for the pipeline and restored.

A pipeline splits the batch along dim 0 and joins its micro-batches' outputs along dim 0.
Two kinds of model outputs without the batch along dim 0 still come back from it:

- ``rows``: ``k`` rows per sample, sample after sample (a router's logits over the tokens,
  ``(batch * tokens, experts)``, as ``x.view(-1, d)`` lays them out). The graph returns them
  as ``(batch, k, ...)``; the pipeline's output is flattened back.
- ``mean``: a 0-d tensor (a loss the model adds to its output, a router's auxiliary loss),
  computed per micro-batch. The graph returns it repeated once per sample; the pipeline's
  output is the mean over the rows, i.e. the micro-batches' values weighted by their sizes:
  the plain model's value for a mean over the samples, and for a router's load-balancing
  loss the micro-batches' own, as under gradient accumulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.export import is_symbolic
from autopipe.graph.flat_io import MEAN, ROWS
from autopipe.graph.values import ValueInfo, record_values

__all__: list[str] = []  # internal to the package


def _kind(node: fx.Node, shape: Sequence[int], batch: int, label: str) -> str | None:
    """The output's kind: ``None`` when it is batch-major already.

    Raises:
        ValueError: its dim 0 does not follow the batch.
    """
    if not shape:
        return MEAN
    value = node.meta.get("val")
    size = value.shape[0] if isinstance(value, Tensor) and value.dim() else None
    if isinstance(value, Tensor):  # export: the batch is a symbol, its multiples are exact
        rows = _per_sample(size, node.graph)
        if rows == 1:
            return None
        if rows is not None and rows.is_Integer and rows > 1:
            return ROWS
    elif shape[0] == batch:
        return None
    elif shape[0] % batch == 0:
        return ROWS
    raise ValueError(
        f"output {label} has {shape[0] if size is None else size} rows along dim 0 for a "
        f"batch of {batch}; wrap() needs outputs with the batch along dim 0 (a whole number "
        "of rows per sample, or a 0-d tensor)"
    )


def _per_sample(size: object, graph: fx.Graph) -> Any:
    """An export graph's symbolic size divided by the batch's symbol (``None``: a constant)."""
    if not isinstance(size, torch.SymInt) or not is_symbolic(size):
        return None
    batch = graph.find_nodes(op="placeholder")[0].meta["val"].shape[0]
    return size.node.expr / batch.node.expr


def batch_major_outputs(
    graph: fx.Graph,
    values: dict[str, ValueInfo],
    batch: int,
    labels: Sequence[str],
    sample: tuple[nn.Module, tuple[Tensor, ...]] | None = None,
) -> dict[int, str]:
    """Makes the graph return every tensor output with the batch along dim 0.

    ``rows`` outputs are unflattened and ``mean`` ones repeated per sample, by nodes added
    before the output (the last unit's code); ``values`` gets their descriptions. An fx
    graph's sizes are the sample's only: given its root and the sample, it runs again on
    half the sample to check that such an output's rows follow the batch.

    Returns:
        The kind of each output that was changed, by its position in the flat outputs.

    Raises:
        ValueError: an output does not follow the batch, or a 0-d output comes with no
            batch-major output to take the batch size from.
    """
    (output,) = graph.find_nodes(op="output")
    returned: list[fx.Node] = list(output.args[0])
    shapes = [values[n.name].shape or () for n in returned]
    kinds = {
        i: kind
        for i, (node, shape) in enumerate(zip(returned, shapes))
        if (kind := _kind(node, shape, batch, labels[i])) is not None
    }
    if not kinds:
        return kinds
    _check_rows(returned, shapes, kinds, batch, labels, sample)
    # The micro-batch's size, from an output the last unit holds anyway.
    sized = [n for i, n in enumerate(returned) if i not in kinds]
    if not sized:
        listed = ", ".join(labels[i] for i in kinds)
        raise ValueError(
            f"outputs {listed} are 0-d tensors or hold several rows per sample, and no output "
            "has just the batch along dim 0; wrap() needs one batch-major output to size the "
            "micro-batches' (return the per-sample values too, or compute losses outside)"
        )
    source = sized[0]
    restored = list(returned)
    with graph.inserting_before(output):
        size = graph.call_function(torch.ops.aten.sym_size.int, (source, 0))
        if source.meta.get("val") is not None:
            size.meta["val"] = source.meta["val"].shape[0]
        values[size.name] = ValueInfo("simple", "int")
        for i, kind in kinds.items():
            if kind == ROWS:
                restored[i] = _unflatten(graph, returned[i], size, values, batch)
            else:
                restored[i] = _repeat(graph, returned[i], size, values, batch)
    output.args = (tuple(restored),)
    return kinds


def per_micro_batch_note(labels: Sequence[str], chunks: int) -> str:
    """What a pipeline of ``chunks`` micro-batches returns for outputs the model computes
    once per batch (a loss), said once where it runs them."""
    listed = ", ".join(label.strip("[]'\"") for label in labels)  # ['loss'] reads loss
    return (
        f"the model's 0-d outputs ({listed}) are computed on each of the {chunks} "
        "micro-batches and averaged over the samples: a loss that is a mean over the tokens "
        "equals the whole batch's, a router's load-balancing loss is the micro-batches' own "
        "(as under gradient accumulation), not the whole batch's; chunks=1 gives the "
        "plain model's"
    )


def _check_rows(
    returned: Sequence[fx.Node],
    shapes: Sequence[Sequence[int]],
    kinds: Mapping[int, str],
    batch: int,
    labels: Sequence[str],
    sample: tuple[nn.Module, tuple[Tensor, ...]] | None,
) -> None:
    """Checks on half the batch that the ``rows`` outputs have as many rows per sample."""
    rows = [i for i, kind in kinds.items() if kind == ROWS]
    if not rows or sample is None or batch < 2:
        return
    (root, tensors), half = sample, batch // 2
    graph = returned[0].graph
    try:
        again = record_values(root, graph, tuple(t[:half] for t in tensors))[0]
    except Exception:  # code that needs the whole sample: its sizes stand
        return
    for i in rows:
        shape = again[returned[i].name].shape
        if not shape or shape[0] * batch != shapes[i][0] * half:
            raise ValueError(
                f"output {labels[i]} has {shapes[i][0]} rows along dim 0 for a batch of "
                f"{batch} but {shape[0] if shape else 0} for {half}; wrap() needs outputs with "
                "the batch along dim 0 (a whole number of rows per sample, or a 0-d tensor)"
            )


def _unflatten(
    graph: fx.Graph, node: fx.Node, size: fx.Node, values: dict[str, ValueInfo], batch: int
) -> fx.Node:
    """``node`` as ``(batch, rows per sample, ...)``; a view, no copy."""
    made = graph.call_function(torch.ops.aten.unflatten.int, (node, 0, [size, -1]))
    info = values[node.name]
    shape = info.shape or ()
    per_sample = (batch, int(shape[0]) // batch, *shape[1:])
    values[made.name] = ValueInfo("tensor", info.type_name, info.nbytes, per_sample)
    _fake(made, node, lambda t, n: t.unflatten(0, (n, -1)), size)
    return made


def _repeat(
    graph: fx.Graph, node: fx.Node, size: fx.Node, values: dict[str, ValueInfo], batch: int
) -> fx.Node:
    """The 0-d ``node`` once per sample: an expanded view, no copy."""
    made = graph.call_function(torch.ops.aten.expand.default, (node, [size]))
    info = values[node.name]
    values[made.name] = ValueInfo("tensor", info.type_name, info.nbytes, (batch,))
    _fake(made, node, lambda t, n: t.expand(n), size)
    return made


def _fake(made: fx.Node, node: fx.Node, op: object, size: fx.Node) -> None:
    """Export's metadata (a fake value with the symbolic batch) for a node made here."""
    value, extent = node.meta.get("val"), size.meta.get("val")
    if isinstance(value, Tensor) and extent is not None:
        made.meta["val"] = op(value, extent)  # type: ignore[operator]
