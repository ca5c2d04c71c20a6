"""Finds the activations a layer's weight GEMMs take: what an FP8 recipe saves in FP8.

Megatron's FP8 recipe (Transformer Engine) and DeepSeek-V3 quantize the input of every
linear layer's GEMM and save that FP8 copy for the weight gradient; the other saved
tensors (attention's queries, keys, values and output, norms' inputs, activations'
inputs) stay in the model's dtype. :class:`GemmInputs` watches a forward below autograd
and records the storages that are the activation operand of a matrix product whose other
operand comes from the layer's state alone: a parameter, a view of it, its cast under
autocast, a slice of a stack of expert weights. Products of two activations (attention's
scores and weighted sum) are no weight GEMMs and are left out.

A storage that another operation saves too (a ReLU's output, which its backward needs,
taken by the next linear layer) stays in the model's dtype beside the GEMM's FP8 copy:
:func:`gemm_only` keeps the storages that weight GEMMs alone save, walking the autograd
graph the forward built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiler.storages import storage_key

__all__: list[str] = []

aten = torch.ops.aten


def _gemm_operands() -> dict[Any, tuple[int, int]]:
    """The two matrix operands' positions of each matrix product, as dispatch sees it."""
    found: dict[Any, tuple[int, int]] = {
        aten.mm.default: (0, 1),
        aten.bmm.default: (0, 1),
        aten.mv.default: (0, 1),
        aten.matmul.default: (0, 1),
        aten.linear.default: (0, 1),
        aten.addmm.default: (1, 2),
        aten.baddbmm.default: (1, 2),
        aten.addmv.default: (1, 2),
    }
    # The grouped GEMM of routed experts (newer torch only): tokens × a stack of weights.
    grouped = getattr(aten, "_grouped_mm", None)
    if grouped is not None:
        found[grouped.default] = (0, 1)
    return found


GEMM_OPERANDS = _gemm_operands()


class GemmInputs(TorchDispatchMode):
    """Records the storages of the activation operands of weight GEMMs during a forward.

    An operation whose tensor inputs all come from the layer's state makes state too (a
    weight's transpose, its bfloat16 copy under autocast), so a GEMM is a weight GEMM
    when exactly one of its two matrix operands is state; the other one's storage is
    recorded in :attr:`inputs`.

    Args:
        state: the storage identities of the layer's parameters and buffers
            (:func:`profiler.layer.state_storages`).
    """

    def __init__(self, state: AbstractSet[int]) -> None:
        super().__init__()
        self.state = set(state)
        self.inputs: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        operands = GEMM_OPERANDS.get(func)
        if operands is not None:
            first, second = (args[i] if i < len(args) else None for i in operands)
            if isinstance(first, Tensor) and isinstance(second, Tensor):
                weights = [self._is_state(first), self._is_state(second)]
                if weights == [True, False]:
                    self.inputs.add(storage_key(second)[0])
                elif weights == [False, True]:
                    self.inputs.add(storage_key(first)[0])
            return out
        given = [v for v in tree_leaves((args, kwargs)) if isinstance(v, Tensor)]
        if given and all(self._is_state(t) for t in given):
            for value in tree_leaves(out):
                if isinstance(value, Tensor):
                    self.state.add(storage_key(value)[0])
        return out

    def _is_state(self, tensor: Tensor) -> bool:
        return storage_key(tensor)[0] in self.state


def _is_gemm(node: Any) -> bool:
    """Whether an autograd node is a matrix product's backward."""
    name = type(node).__name__
    return name in _GEMM_NODES or "GroupedMm" in name


_GEMM_NODES = {
    "MmBackward0",
    "AddmmBackward0",
    "BmmBackward0",
    "BaddbmmBackward0",
    "MvBackward0",
    "AddmvBackward0",
}


def _saved_tensors(node: Any) -> Iterator[Tensor]:
    """The tensors an autograd node saved: a built-in node's ``_saved_*`` attributes, a
    custom function's ``saved_tensors``."""
    names = [n for n in dir(node) if n.startswith("_saved_")]
    if hasattr(node, "saved_tensors"):
        names.append("saved_tensors")
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed or not a tensor it can give back
            continue
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, Tensor):
                yield item


def _nodes(targets: Sequence[Tensor]) -> Iterator[Any]:
    """Every autograd node behind ``targets``, each once."""
    pending = [t.grad_fn for t in targets if t.grad_fn is not None]
    seen: set[int] = set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        pending.extend(n for n, _ in node.next_functions if n is not None)


def gemm_only(targets: Sequence[Tensor], gemms: GemmInputs) -> set[int]:
    """The storages of weight GEMMs' activation operands that no other operation saves.

    Args:
        targets: the forward's outputs, whose autograd graph saved the tensors.
        gemms: what watched the forward.
    """
    taken: set[int] = set()
    kept: set[int] = set()  # saved by other operations (or as another operand)
    for node in _nodes(targets):
        gemm = _is_gemm(node)
        for tensor in _saved_tensors(node):
            key = storage_key(tensor)[0]
            if gemm and key in gemms.inputs:
                taken.add(key)
            elif key not in gemms.state:
                kept.add(key)
    return taken - kept
