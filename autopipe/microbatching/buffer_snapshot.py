"""The buffers a re-computed forward must see: those its first run saw, not later ones.

A forward that writes a buffer in place (a step counter, ``self.count += 1``; running
statistics) and reads it back computes with the value of that moment. Re-computed in
backward, it would find the buffer already moved by its own first run (and by the later
micro-batches' forwards) and compute something else: gradients that silently differ from
the plain model's. So the written buffers' values are taken before the first run, and the
re-computation runs on copies of them: it computes what the first run computed, and its own
writes go to the copies, so nothing is counted twice.

Which buffers: in a traced unit, those its graph may write
(:func:`autopipe.graph.graph_writes`), taken before the first run. The code of any other
module cannot be read: the stage modules of ``DistributedPipeline`` (whose units are an
``nn.Sequential``'s own children) take its small buffers as well (:data:`SMALL_BUFFER`:
counters, statistics), and copy the larger ones (tables a forward reads, which a copy per
micro-batch in flight would cost memory for) as they are at the re-computation; GPipe keeps
torchgpipe's rule for the layers of an ``nn.Sequential`` it is given: the live buffers,
which :func:`~autopipe.microbatching.is_recomputing` lets a layer tell apart.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph import graph_writes

__all__ = ["BufferSnapshot", "per_micro_batch_writes"]


# A graph's writes, read once: a snapshot is taken at every checkpointed micro-batch, and
# reading a unit's graph costs tens of microseconds a unit.
_GRAPH_WRITES: weakref.WeakKeyDictionary[fx.GraphModule, list[tuple[nn.Module, str]]] = (
    weakref.WeakKeyDictionary()
)


def _written(module: nn.Module, graphs_only: bool = False) -> Iterator[tuple[nn.Module, str]]:
    """The buffers ``module`` may write: a traced graph's as it says, any other module's
    all (none with ``graphs_only``)."""
    if isinstance(module, fx.GraphModule):
        found = _GRAPH_WRITES.get(module)
        if found is None:
            found = _GRAPH_WRITES[module] = graph_writes(module)
        yield from found
        return
    if not graphs_only:
        for name, buffer in module._buffers.items():
            if buffer is not None:
                yield module, name
    for child in module.children():
        yield from _written(child, graphs_only)


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


# Other modules' buffers up to this size are taken too where the runner asks: counters and
# statistics are bytes; what is larger is a table (a causal mask per layer, say), which a
# copy per micro-batch in flight would cost memory for, and which forwards only read.
SMALL_BUFFER = 1 << 20


class BufferSnapshot:
    """The values of the buffers ``owner``'s traced units may write, taken now (before its
    forward), and its other modules' buffers, to copy at the re-computation.

    Args:
        owner: the module about to run a forward that will be re-computed.
        small: take the other modules' buffers of at most :data:`SMALL_BUFFER` bytes too
            (their code cannot be read: any may be written); the larger ones stay others.
    """

    def __init__(self, owner: nn.Module, small: bool = False) -> None:
        taken: dict[tuple[int, str], tuple[nn.Module, str, Tensor]] = {}
        for module, name in _written(owner, graphs_only=True):
            buffer = module._buffers[name]
            assert buffer is not None
            taken.setdefault((id(module), name), (module, name, buffer.detach().clone()))
        self.others: list[tuple[nn.Module, str]] = []
        for module, name in _written(owner):
            if (id(module), name) in taken:
                continue
            buffer = module._buffers[name]
            assert buffer is not None
            if small and buffer.numel() * buffer.element_size() <= SMALL_BUFFER:
                taken[id(module), name] = (module, name, buffer.detach().clone())
            else:
                self.others.append((module, name))
        self.values = list(taken.values())

    @contextlib.contextmanager
    def restored(self, copy_others: bool = False) -> Iterator[None]:
        """Runs the block with copies of the taken values in place of the live buffers
        (and, with ``copy_others``, copies of the other buffers' values now), then puts the
        live buffers back, unchanged by the block."""
        swapped = [(module, name, value.clone()) for module, name, value in self.values]
        if copy_others:
            swapped += [
                (module, name, module._buffers[name].detach().clone())  # type: ignore[union-attr]
                for module, name in self.others
            ]
        live = [(module, name, module._buffers[name]) for module, name, _ in swapped]
        for module, name, value in swapped:
            module._buffers[name] = value
        try:
            yield
        finally:
            for module, name, tensor in live:
                module._buffers[name] = tensor
