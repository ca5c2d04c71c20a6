"""What re-computing a latent attention's up-projections in the backward frees and costs.

Multi-head latent attention (DeepSeek-V2 and V3, Kimi K2) projects each token down to small
latents and back up to every head's queries, keys and values, which the attention kernel
then saves for its backward: at DeepSeek-V3's 128 heads, about 128 KB per token and block
in bfloat16 against the latents' 4 KB. Megatron-LM's ``--recompute-modules mla_up_proj``
(and DeepSeek-V3's training) keeps the latents only: the backward runs the
up-projections, the rotary embedding and the concatenation that make the attention's
inputs once more. Counted in the layer's counting forward, below autograd:

- the region: the operations inside an up-projection module (Hugging Face's ``q_b_proj``
  and ``kv_b_proj``, Megatron-LM's ``linear_q_up_proj`` and ``linear_kv_up_proj``) and
  every later one that reads what the region made, until the core attention takes it (a
  fused attention kernel, or a product of two of the region's tensors: eager attention's
  scores), whose own outputs and saved tensors stay;
- the bytes of the layer's saved tensors the region made (each storage once): what the
  re-computation frees per micro-batch;
- the region's FLOPs, memory traffic and operations: what the backward runs again.

In a traced unit the modules are gone: the nodes each up-projection left
(``nn_module_stack``) are marked on the counting copy, as the norms' are
(:func:`profiler.norm_counting.mark_regions`), so the same figures come out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiler.norm_counting import Work, hooked, mark_regions
from profiler.storages import storage_key

__all__: list[str] = []

aten = torch.ops.aten

# The up-projections' module names: Hugging Face's MLA attention and Megatron-LM's.
UP_PROJECTIONS = ("q_b_proj", "kv_b_proj", "linear_q_up_proj", "linear_kv_up_proj")
# Products whose two operands both came from the region: eager attention's scores.
_PRODUCTS = (aten.bmm.default, aten.mm.default, aten.baddbmm.default)

# The watch the marks of a traced graph report to, while one is watching.
_ACTIVE: list[UpProjectionWatch] = []


def is_up_projection(path: str) -> bool:
    """Whether the module at ``path`` (dotted, in its layer) is an up-projection."""
    return path.rpartition(".")[2] in UP_PROJECTIONS


def up_projection_entered(region: str, *inputs: Any) -> None:
    """A marked graph enters an up-projection's nodes."""
    if _ACTIVE:
        _ACTIVE[-1].enter()


def up_projection_left(region: str, *outputs: Any) -> None:
    """A marked graph leaves an up-projection's nodes."""
    if _ACTIVE:
        _ACTIVE[-1].leave()


def _up_path(node: fx.Node) -> str | None:
    """The innermost up-projection module a node was traced in, by its path."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        if is_up_projection(str(path)):
            return str(path)
    return None


def _is_attention(func: Any, args: Any, made: set[int]) -> bool:
    """Whether ``func`` is the core attention taking the region's tensors."""
    name = str(getattr(func, "__name__", func))
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return True
    if func in _PRODUCTS:
        matrices = [a for a in args if isinstance(a, Tensor) and a.dim() >= 2][-2:]
        return len(matrices) == 2 and all(storage_key(m)[0] in made for m in matrices)
    return False


class UpProjectionWatch(TorchDispatchMode):
    """Records, during one forward, what the up-projections' region makes and runs.

    Enter :meth:`watching` inside the modes that count the pass (it reads their totals
    around each of the region's operations).

    Args:
        layer: the layer whose up-projections are watched.
        totals: the pass's work counted so far.
    """

    def __init__(self, layer: nn.Module, totals: Callable[[], Work]) -> None:
        super().__init__()
        self.modules = [m for name, m in layer.named_modules() if name and is_up_projection(name)]
        for module in layer.modules():
            if isinstance(module, fx.GraphModule):
                mark_regions(module, _up_path, up_projection_entered, up_projection_left)
        self.totals = totals
        self.made: set[int] = set()
        self.flops = 0.0
        self.traffic = 0.0
        self.operations = 0
        self._live: set[int] = set()
        # The region's tensors, held so that no later storage takes a freed one's identity.
        self._held: list[Tensor] = []
        self._depth = 0

    def enter(self, *_: Any) -> None:
        self._depth += 1

    def leave(self, *_: Any) -> None:
        self._depth -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        read = {storage_key(t)[0] for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        reads = not read.isdisjoint(self._live)
        if self._depth == 0 and (not reads or _is_attention(func, args, self._live)):
            if reads:  # the core attention takes the region's tensors: the region ends
                self._live.clear()
            return func(*args, **kwargs)
        before = self.totals()
        out = func(*args, **kwargs)
        after = self.totals()
        self.flops += after.flops - before.flops
        self.traffic += after.traffic - before.traffic
        self.operations += after.operations - before.operations
        for leaf in tree_leaves(out):
            if isinstance(leaf, Tensor):
                key = storage_key(leaf)[0]
                if key in read and key not in self._live:
                    continue  # a view of (or a write into) what the region reads
                self.made.add(key)
                self._live.add(key)
                self._held.append(leaf)
        return out

    @contextmanager
    def watching(self) -> Iterator[UpProjectionWatch]:
        _ACTIVE.append(self)
        try:
            with hooked(self.modules, self.enter, self.leave), self:
                yield self
        finally:
            _ACTIVE.remove(self)
            self._held.clear()

    def saved_outputs(self, saved: list[Tensor]) -> list[Tensor]:
        """Of the tensors the forward saved, those the region made."""
        return [t for t in saved if storage_key(t)[0] in self.made]
