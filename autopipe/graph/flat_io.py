"""Model inputs and outputs as flat tuples of tensors, with their structure to rebuild them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

__all__ = ["FlatSpec"]

# Outputs that travel batch-major but are returned otherwise (autopipe.graph.batch_outputs).
MEAN, ROWS = "mean", "rows"


def restore(tensor: Tensor, kind: str | None) -> Tensor:
    """A joined batch-major output as the model returns it: ``mean`` (a 0-d value repeated
    once per sample) averaged, ``rows`` (``(batch, k, ...)``) flattened to ``k`` rows per
    sample; any other unchanged."""
    if kind == MEAN:
        # Summed in float64, the mean of two equal micro-batches' float32 losses is their
        # mean rounded once, as the plain average of the two gives it.
        return tensor.mean(dtype=torch.float64).to(tensor.dtype)
    if kind == ROWS:
        return tensor.flatten(0, 1)
    return tensor


def _same(a: Any, b: Any) -> bool:
    """Whether two constant leaves are equal (identity first: ``nan`` and odd ``__eq__``)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


@dataclass
class FlatSpec:
    """The structure of a nested value whose tensors travel as one flat tuple.

    Attributes:
        spec: the pytree structure of the value.
        leaves: every leaf; the constants (ints, bools, ``None``...) are kept, the tensors'
            slots hold ``None``.
        slots: the positions of the tensor leaves, in the order of the flat tuple.
        labels: a readable path of every leaf, e.g. ``[0]`` or ``['mask']``.
        kinds: outputs that travel batch-major but are returned otherwise, by position in
            the flat tuple: ``rows`` or ``mean`` (see :mod:`autopipe.graph.batch_outputs`).
    """

    spec: pytree.TreeSpec
    leaves: list[Any]
    slots: list[int]
    labels: list[str]
    kinds: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls, value: Any, top: Sequence[str] | None = None
    ) -> tuple[FlatSpec, tuple[Tensor, ...]]:
        """The structure of ``value`` and its tensors, in flattening order.

        Args:
            value: a nested structure of tensors and constants.
            top: names for the items of a top-level tuple in the labels, e.g.
                ``("args", "kwargs")``.
        """
        with_paths, spec = pytree.tree_flatten_with_path(value)
        labels = []
        for path, _ in with_paths:
            if top is not None and path:
                labels.append(top[path[0].idx] + pytree.keystr(path[1:]))  # type: ignore[attr-defined]
            else:
                labels.append(pytree.keystr(path))
        leaves = [leaf for _, leaf in with_paths]
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        constants = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        return cls(spec, constants, slots, labels), tuple(leaves[i] for i in slots)

    def label(self, index: int) -> str:
        """The path of the ``index``-th tensor."""
        return self.labels[self.slots[index]]

    def flatten(self, value: Any, what: str) -> tuple[Tensor, ...]:
        """The tensors of ``value``, which must have this structure and these constants.

        Raises:
            ValueError: the structure or a constant leaf differs from the traced one.
        """
        leaves, spec = pytree.tree_flatten(value)
        if spec != self.spec:
            raise ValueError(
                f"the {what} do not have the structure the model was traced with: expected "
                f"{self.spec}, got {spec}"
            )
        tensors = []
        for i, (leaf, traced) in enumerate(zip(leaves, self.leaves)):
            if i in self._slot_set:
                if not isinstance(leaf, Tensor):
                    raise ValueError(
                        f"{what}: {self.labels[i]} was a tensor when traced, got "
                        f"{type(leaf).__name__}"
                    )
                tensors.append(leaf)
            elif not _same(leaf, traced):
                raise ValueError(
                    f"{what}: {self.labels[i]} was the constant {traced!r} when traced and is "
                    f"baked into the graph; got {leaf!r}: wrap the model again to change it"
                )
        return tuple(tensors)

    def rebuild(self, tensors: Sequence[Any]) -> Any:
        """The nested value with ``tensors`` in the tensor slots and the constants elsewhere."""
        leaves = list(self.leaves)
        for i, (slot, tensor) in enumerate(zip(self.slots, tensors, strict=True)):
            leaves[slot] = restore(tensor, self.kinds.get(i))
        return pytree.tree_unflatten(leaves, self.spec)

    @property
    def _slot_set(self) -> set[int]:
        return set(self.slots)


def check_batch_major(shapes: Sequence[Sequence[int]], labels: Sequence[str], what: str) -> int:
    """Checks that tensors of these shapes share a non-empty dim 0; returns its size.

    Raises:
        ValueError: there is no tensor, a tensor is 0-d, or the sizes of dim 0 differ.
    """
    if not shapes:
        raise ValueError(
            f"the model's {what} contain no tensor; wrap() needs batch-major tensor {what}"
        )
    for shape, label in zip(shapes, labels):
        if len(shape) == 0:
            raise ValueError(
                f"{what} {label} is a 0-d tensor; wrap() needs batch-major {what}: every "
                "tensor with the batch along dim 0 (compute losses and other reductions outside)"
            )
    sizes = {label: int(shape[0]) for shape, label in zip(shapes, labels)}
    if len(set(sizes.values())) != 1:
        listed = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise ValueError(
            f"wrap() needs batch-major {what}, all with the batch along dim 0, but their "
            f"dim-0 sizes differ ({listed})"
        )
    size = next(iter(sizes.values()))
    if size == 0:
        raise ValueError(f"the {what} have an empty batch (dim 0 is 0)")
    return int(size)
