"""Counts what tensor parallelism shards of one layer, and what it communicates.

The layer's forward and backward run once on fake tensors (with the other counts, see
:func:`profiler.counting.count_layer`) under :class:`ShardFlow`, a dispatch mode that
follows which tensors a tensor-parallel group holds *sharded* (each device a share),
*partial* (each device a summand of the whole) or *replicated* (each device all of it),
from the styles of the layer's parameters:

- a column-wise weight's matmul makes a sharded output, and in the backward the gradient
  of its (replicated) input is all-reduced: each distinct such input once;
- a row-wise weight's matmul makes a partial output, all-reduced in the forward and
  replicated after (a ``local_rowwise`` one stays partial until a use needs it whole);
- a vocabulary-sharded embedding (``embedding_rowwise``) makes a partial output,
  all-reduced;
- any other operation with a sharded tensor input (and no partial one) makes a sharded
  output: attention on a share of the heads, the MLP's activation, views and casts;
- a partial tensor is all-reduced where an operation other than a sum or a scaling uses
  it, or where it leaves the layer; a sharded tensor leaving the layer is gathered (the
  next layer takes its inputs whole).

An operation is *sharded* when its output is (or a styled weight takes part): its FLOPs
(torch's flop counter, per operation) and memory traffic go to the sharded figures, which
``t`` devices divide. Attention (``scaled_dot_product_attention``'s fused kernels, the
CPU's included, which torch's flop counter does not know) is recorded whatever the plan:
its FLOPs, the bytes of its keys and values, its heads. Attention written as separate
matmuls and a softmax counts as those operations, not as attention.

Shards are counted whenever a plan is given, even an empty one: that is how a count asks
for the attention figures that context parallelism needs without tensor parallelism.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiler.layer import storage_key
from profiler.op_flops import ATTENTION, ATTENTION_BACKWARD, op_flops
from profiler.tp_styles import COLUMN, EMBEDDING, GATHERED, SHARD_STYLES, sharded_roles

__all__: list[str] = []

aten = torch.ops.aten

# Labels besides a sharded parameter's style; replicated activations have none.
SHARDED, PARTIAL, STATE = "sharded", "partial", "state"

_MATMULS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten.addmv.default,
    aten.matmul.default,
    aten.linear.default,
}
# Linear in a partial tensor: the result is a partial of the whole result.
_KEEP_PARTIAL = {
    aten.add.Tensor,
    aten.add_.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.mul_.Tensor,
    aten.div.Tensor,
    aten.neg.default,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.index_add.default,
    aten.index_add_.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.copy_.default,
}


@dataclass
class ShardFigures:
    """One layer's shard counts at one batch size (see :class:`profiler.ShardCounts`)."""

    flops: float = 0.0
    backward_flops: float = 0.0
    backward_input_flops: float = 0.0
    traffic: float = 0.0
    backward_traffic: float = 0.0
    saved: int = 0
    param_bytes: int = 0
    reduce_forward: int = 0
    reduce_backward: int = 0
    reductions: int = 0
    replicated_saved: int = 0
    attention_flops: float = 0.0
    attention_backward_flops: float = 0.0
    kv_bytes: int = 0
    attention_calls: int = 0
    heads: int = 0
    kv_heads: int = 0
    # Storages whose gradient the backward all-reduces, with their bytes.
    reduced_inputs: dict[int, int] = field(default_factory=dict)


class ShardFlow(TorchDispatchMode):
    """Labels every tensor sharded, partial or replicated as the layer runs, and sums the
    sharded operations' FLOPs and traffic.

    Args:
        layer: the layer, its state already the tensors it runs with.
        styles: the style of the module owning each parameter, by the parameter's name in
            ``layer``; parameters not named are replicated.
        traffic: the bytes one operation moves (``None`` when it moves none), as the
            layer's traffic counts them.
    """

    def __init__(
        self,
        layer: nn.Module,
        styles: Mapping[str, str],
        traffic: Any,
    ) -> None:
        super().__init__()
        self.figures = ShardFigures()
        self.backward = False
        self.op_traffic = traffic
        self.labels: dict[int, str] = {}
        self.keep: list[Tensor] = []  # storages stay alive, so their identities stay unique
        self.embeddings: set[int] = set()  # rows of the vocabulary-sharded embeddings
        # A cast's source: autocast casts an input once per matmul, but the gradients of
        # the casts sum into one, which is all-reduced once.
        self.origin: dict[int, int] = {}
        # Copies of broadcast views (grouped keys repeated to the query's heads before
        # attention): the share of their elements that is distinct.
        self.repeated: dict[int, float] = {}
        seen: set[int] = set()
        for name, tensor in (*layer.named_parameters(), *layer.named_buffers()):
            key = storage_key(tensor)[0]
            style = styles.get(name)
            if style is not None and sharded_roles(style, name):
                self.labels[key] = style
                if key not in seen:
                    self.figures.param_bytes += tensor.numel() * tensor.element_size()
            else:
                self.labels.setdefault(key, STATE)
            seen.add(key)
            self.keep.append(tensor)

    def label(self, tensor: Tensor) -> str | None:
        return self.labels.get(storage_key(tensor)[0])

    def _reduce(self, tensor: Tensor) -> None:
        """A forward all-reduce (or all-gather) of the whole ``tensor``."""
        self.figures.reduce_forward += tensor.numel() * tensor.element_size()
        self.figures.reductions += 1

    def leave(self, outputs: list[Tensor]) -> None:
        """The layer's outputs leave it whole: a partial one is reduced, a sharded one
        gathered."""
        for tensor in outputs:
            label = self.label(tensor)
            if label in (PARTIAL, SHARDED) or label in SHARD_STYLES:
                self._reduce(tensor)
                self.labels[storage_key(tensor)[0]] = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        if not outputs:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        label, sharded = self._flow(func, args, inputs, outputs)
        if func in ATTENTION or func in ATTENTION_BACKWARD:
            self._attention(func, args, kwargs, out)
        if sharded:
            flops = op_flops(func, args, kwargs, out)
            moved = self.op_traffic(func, args, kwargs, out) or 0
            if self.backward:
                self.figures.backward_flops += flops
                self.figures.backward_traffic += moved
            else:
                self.figures.flops += flops
                self.figures.traffic += moved
        known = {storage_key(t)[0] for t in inputs}
        for tensor in outputs:
            key = storage_key(tensor)[0]
            if key not in known:  # a new tensor; views and in-place results keep theirs
                self.labels[key] = label
                self.keep.append(tensor)
                if func is aten._to_copy.default:
                    source = storage_key(inputs[0])[0]
                    self.origin[key] = self.origin.get(source, source)
                if func is aten.clone.default and inputs[0].numel():
                    distinct = math.prod(
                        n
                        for n, step in zip(inputs[0].shape, inputs[0].stride(), strict=True)
                        if step != 0
                    )
                    if distinct < inputs[0].numel():
                        self.repeated[key] = distinct / inputs[0].numel()
        return out

    def _flow(
        self, func: Any, args: Any, inputs: list[Tensor], outputs: list[Tensor]
    ) -> tuple[str, bool]:
        """The label of the operation's new outputs, and whether it runs sharded."""
        labels = [self.label(t) for t in inputs]
        if PARTIAL in labels:
            partial_ok = func in _KEEP_PARTIAL and SHARDED not in labels
            if func in (aten.mul.Tensor, aten.mul_.Tensor, aten.div.Tensor):
                partial_ok = partial_ok and labels.count(PARTIAL) == 1
            if partial_ok:
                return PARTIAL, True
            for tensor, found in zip(inputs, labels, strict=True):
                if found == PARTIAL:  # reduced before this use needs it whole
                    self._reduce(tensor)
                    self.labels[storage_key(tensor)[0]] = ""
            labels = [self.label(t) for t in inputs]
        styles = [(t, s) for t, s in zip(inputs, labels, strict=True) if s in SHARD_STYLES]
        if func in _MATMULS and styles:
            return self._matmul(inputs, labels, styles[0][1], outputs[0])
        if func is aten.embedding.default and labels[0] in EMBEDDING:
            self.embeddings.add(inputs[0].shape[0])
            self._reduce(outputs[0])  # each device looks up its rows: partial, all-reduced
            return "", True
        # num_weights: a sharded vocabulary's rows, whose gradient is sharded too.
        if func is aten.embedding_dense_backward.default and int(args[2]) in self.embeddings:
            return SHARDED, True
        if SHARDED in labels:
            return SHARDED, True
        activations = [s for s in labels if s is None or s == ""]
        if styles and not activations:
            return styles[0][1], True  # a sharded weight's cast or view: still its style
        if inputs and all(s == STATE for s in labels):
            return STATE, False
        return "", False

    def _matmul(
        self, inputs: list[Tensor], labels: list[str | None], style: str, output: Tensor
    ) -> tuple[str, bool]:
        column = style in COLUMN or style == "local"
        if self.backward:
            # grad_input = grad @ W sums over the sharded features for a column-wise W
            # (the all-reduce counted from the forward's inputs); a row-wise W's gives the
            # sharded input's gradient.
            return ("" if column else SHARDED), True
        if column:
            if style != "local_colwise" and style != "local":
                for tensor, found in zip(inputs, labels, strict=True):
                    if found in (None, "") and tensor.requires_grad:
                        key = storage_key(tensor)[0]
                        nbytes = tensor.numel() * tensor.element_size()
                        self.figures.reduced_inputs[self.origin.get(key, key)] = nbytes
            if style in GATHERED:
                self._reduce(output)
                return "", True
            return SHARDED, True
        if style == "local_rowwise":
            return PARTIAL, True
        self._reduce(output)
        return "", True

    def _attention(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        figures = self.figures
        if func in ATTENTION_BACKWARD:
            figures.attention_backward_flops += op_flops(func, args, kwargs, out)
            return
        query, key, value = args[0], args[1], args[2]
        figures.attention_flops += op_flops(func, args, kwargs, out)
        figures.attention_calls += 1
        # Repeated keys and values count as the grouped ones they repeat: what a
        # context-parallel ring passes, and the heads tensor parallelism can split.
        share = [self.repeated.get(storage_key(t)[0], 1.0) for t in (key, value)]
        pairs = zip((key, value), share, strict=True)
        figures.kv_bytes += sum(round(t.numel() * t.element_size() * r) for t, r in pairs)
        figures.heads = max(figures.heads, int(query.shape[-3]))
        figures.kv_heads = max(figures.kv_heads, round(int(key.shape[-3]) * share[0]))

    def saved(self, tensors: list[Tensor], exclude: set[int]) -> None:
        """Splits the bytes saved for backward (distinct storages, the layer's state left
        out) into sharded ones and replicated activations."""
        seen = set(exclude)
        for tensor in tensors:
            key, nbytes = storage_key(tensor)
            if key in seen:
                continue
            seen.add(key)
            label = self.labels.get(key)
            if label == SHARDED or label in SHARD_STYLES:
                self.figures.saved += nbytes
            elif label != STATE:
                self.figures.replicated_saved += nbytes

    def finish(self, input_pass: ShardFlow | None) -> ShardFigures:
        """The figures; ``input_pass`` followed the pass that computes only the input's
        gradient, whose sharded FLOPs are ``backward_input_flops``."""
        figures = self.figures
        figures.reduce_backward = sum(figures.reduced_inputs.values())
        if input_pass is not None:
            figures.backward_input_flops = min(
                input_pass.figures.backward_flops, figures.backward_flops
            )
        return figures


@contextlib.contextmanager
def saving(into: list[Tensor]) -> Iterator[None]:
    """Collects the tensors autograd saves for backward in the block."""

    def pack(tensor: Tensor) -> Tensor:
        into.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
