"""The buffers a re-computed forward must see: those its first run saw, not later ones.

A forward that writes a buffer in place (a step counter, ``self.count += 1``; running
statistics) and reads it back computes with the value of that moment. Re-computed in
backward, it would find the buffer already moved by its own first run (and by the later
micro-batches' forwards) and compute something else: gradients that silently differ from
the plain model's. So the written buffers' values are taken before the first run, and the
re-computation runs on copies of them: it computes what the first run computed, and its own
writes go to the copies, so nothing is counted twice.

Which buffers: in a traced unit, those its graph may write
(:func:`autopipe.graph.graph_writes`); in any other module, all of its buffers (its code
cannot be read).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph import graph_writes

__all__ = ["BufferSnapshot", "per_micro_batch_writes"]


def _written(module: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    if isinstance(module, fx.GraphModule):
        yield from graph_writes(module)
        return
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield module, name
    for child in module.children():
        yield from _written(child)


# Batch norm's running statistics move once per mini-batch where deferred
# (:class:`~autopipe.microbatching.DeferredBatchNorm`), and a warning says where not.
_BATCH_NORM = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def per_micro_batch_writes(model: nn.Module, units: Iterable[nn.Module]) -> list[str]:
    """The model's buffers, by name, that the units' forwards write in place (batch norm's
    statistics aside): a pipeline writes them once per micro-batch, where the plain model
    writes them once per batch."""
    names = {id(t): n for n, t in model.named_buffers(remove_duplicate=False)}
    found: dict[str, None] = {}
    for unit in units:
        for module, name in _written(unit):
            buffer = module._buffers[name]
            if name not in _BATCH_NORM and id(buffer) in names:
                found[names[id(buffer)]] = None
    return list(found)


class BufferSnapshot:
    """The values of the buffers ``owner`` may write, taken now (before its forward).

    Args:
        owner: the module about to run a forward that will be re-computed.
    """

    def __init__(self, owner: nn.Module) -> None:
        seen: set[tuple[int, str]] = set()
        self.values: list[tuple[nn.Module, str, Tensor]] = []
        for module, name in _written(owner):
            if (id(module), name) not in seen:
                seen.add((id(module), name))
                self.values.append((module, name, module._buffers[name].detach().clone()))  # type: ignore[union-attr]

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        """Runs the block with copies of the taken values in place of the live buffers,
        then puts the live buffers back, unchanged by the block."""
        live = [(module, name, module._buffers[name]) for module, name, _ in self.values]
        for module, name, value in self.values:
            module._buffers[name] = value.clone()
        try:
            yield
        finally:
            for module, name, tensor in live:
                module._buffers[name] = tensor
