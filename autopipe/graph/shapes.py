"""The input shapes and dtypes a torch.export graph holds, and their check before each call."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from autopipe.graph.flat_io import FlatSpec

__all__ = ["DynamicSpec"]

# What wrap(dynamic=) takes: input name (or position) -> the dims that vary.
DynamicSpec = Mapping[str | int, int | Sequence[int] | Mapping[int, Any]]


def _paths(inputs: FlatSpec) -> list[tuple[Any, ...]]:
    """The pytree path of each tensor of ``(args, kwargs)``, in flat order."""
    leaves = pytree.tree_unflatten(list(range(len(inputs.leaves))), inputs.spec)
    paths = [path for path, _ in pytree.tree_flatten_with_path(leaves)[0]]
    return [paths[slot] for slot in inputs.slots]


def _positional_names(model: nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def input_names(model: nn.Module, inputs: FlatSpec) -> list[tuple[str | int, str]]:
    """Each tensor input's top-level key (keyword, or position) and readable name.

    A positional input is named after the parameter of ``forward`` it binds to, e.g.
    ``("x", "x")``, else by position, ``(0, "args[0]")``; a keyword input
    ``("mask", "mask")``; a tensor nested inside an input ``("pair", "pair[1]")``.
    """
    positional = _positional_names(model)
    named: list[tuple[str | int, str]] = []
    for path in _paths(inputs):
        head, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 1:
            named.append((head.key, f"{head.key}{rest}"))
        elif head.idx < len(positional):
            named.append((positional[head.idx], f"{positional[head.idx]}{rest}"))
        else:
            named.append((head.idx, f"args[{head.idx}]{rest}"))
    return named


def _dims_of(value: Any, key: str | int) -> dict[int, Any]:
    """The declared dims of one ``dynamic=`` entry: dim -> ``torch.export.Dim`` or AUTO."""
    if isinstance(value, Mapping):
        return {_dim_index(d, key): spec for d, spec in value.items()}
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, Sequence) or isinstance(items, str):
        raise ValueError(
            f"dynamic[{key!r}] must be a dim, a list of dims or a mapping from dim to "
            f"torch.export.Dim, got {value!r}"
        )
    return {_dim_index(d, key): torch.export.Dim.AUTO for d in items}


def _dim_index(dim: Any, key: str | int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ValueError(f"dynamic[{key!r}] names the dim {dim!r}; dims are integers")
    return dim


def dynamic_dims(
    model: nn.Module,
    inputs: FlatSpec,
    tensors: Sequence[Tensor],
    dynamic: DynamicSpec | None,
) -> list[dict[int, Any]]:
    """The dims besides the batch that export keeps symbolic, per flat tensor input.

    A key of ``dynamic`` names a tensor input by keyword, parameter name or position; its
    dims apply to every tensor inside that input. Dim 0 (the batch) is always free.

    Raises:
        ValueError: an unknown input, a non-tensor input, or a dim out of range.
    """
    dims: list[dict[int, Any]] = [{} for _ in tensors]
    if not dynamic:
        return dims
    if not isinstance(dynamic, Mapping):
        raise ValueError(
            "dynamic must map input names to the dims that vary, e.g. "
            f"dynamic={{'input_ids': 1}}, got {dynamic!r}"
        )
    named = input_names(model, inputs)
    positions = [path[1].idx if path[0].idx == 0 else None for path in _paths(inputs)]
    for key, value in dynamic.items():
        hits = [
            i
            for i, (top, _) in enumerate(named)
            if key == top or (isinstance(key, int) and key == positions[i])
        ]
        if not hits:
            known = ", ".join(repr(name) for _, name in named)
            raise ValueError(
                f"dynamic names the input {key!r}, but the model's tensor inputs are {known}"
            )
        for dim, spec in _dims_of(value, key).items():
            for i in hits:
                ndim = tensors[i].dim()
                if not -ndim <= dim < ndim:
                    raise ValueError(
                        f"dynamic[{key!r}] names dim {dim}, but input {named[i][1]!r} has "
                        f"{ndim} dims"
                    )
                if dim % ndim:  # dim 0 is the batch, free anyway
                    dims[i][dim % ndim] = spec
    return dims


def _shape(dims: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in dims) + (",)" if len(dims) == 1 else ")")


@dataclass
class InputShapes:
    """What an exported graph assumes of its flat tensor inputs.

    Attributes:
        names: each input's top-level key and readable name (see :func:`input_names`).
        sample: the traced sample's shapes.
        dims: each input's dims: an ``int`` where export fixed the size, else a sympy
            expression over the graph's size symbols.
        dtypes: the traced dtypes, which export bakes into the graph.
        batch: the batch's symbol.
        ranges: the sizes each non-batch symbol may take, ``(low, high)`` (``high`` is
            ``None`` when unbounded).
        guards: export's check of the conditions the code branched on (raises
            ``AssertionError``), called with the inputs at ``guard_inputs``; or ``None``.
        placeholders: export's names of the inputs, as the guards' messages use them.
    """

    names: list[tuple[str | int, str]]
    sample: list[tuple[int, ...]]
    dims: list[tuple[Any, ...]]
    dtypes: list[torch.dtype]
    batch: Any
    ranges: dict[Any, tuple[int, int | None]]
    guards: Callable[..., Any] | None
    guard_inputs: list[int]
    placeholders: list[str]

    def check(self, tensors: Sequence[Tensor]) -> None:
        """Checks a call's flat inputs (the whole mini-batch) against the traced ones.

        The conditions are those of the plain model called on the mini-batch: every
        micro-batch runs the path the traced sample took, also when the code branched on
        the batch size.

        Raises:
            ValueError: an input's dtype, number of dims or a fixed size differs, two
                sizes that the graph ties differ, a size is outside its traced range, or
                the inputs break a condition the model's code branched on.
        """
        values: dict[Any, tuple[int, str, int]] = {}
        derived: list[tuple[Any, int, str, int]] = []
        for i, tensor in enumerate(tensors):
            self._check_one(i, tensor, values, derived)
        sizes = {symbol: size for symbol, (size, _, _) in values.items()}
        for expr, size, name, dim in derived:
            if expr.free_symbols <= sizes.keys() and expr.subs(sizes) != size:
                raise ValueError(
                    f"dim {dim} of input {name!r} is {size}, but the traced graph needs "
                    f"{expr.subs(sizes)} there ({expr} in torch.export's sizes); pass sizes "
                    "that agree, or wrap the model again with a sample of these shapes"
                )
        for symbol, (size, name, dim) in values.items():
            low, high = self.ranges.get(symbol, (0, None))
            if size < low or (high is not None and size > high):
                span = f"{low} to {high}" if high is not None else f"{low} and up"
                raise ValueError(
                    f"dim {dim} of input {name!r} is {size}, but the traced graph holds for "
                    f"sizes {span} there (torch.export assumes sizes other than 0 and 1, "
                    "and the model's code may branch on the size); pass a size in that "
                    "range or wrap the model again with a sample of this size"
                )
        if self.guards is not None:
            self._check_guards(tensors)

    def _check_one(
        self,
        i: int,
        tensor: Tensor,
        values: dict[Any, tuple[int, str, int]],
        derived: list[tuple[Any, int, str, int]],
    ) -> None:
        top, name = self.names[i]
        if tensor.dtype != self.dtypes[i]:
            raise ValueError(
                f"input {name!r} has dtype {tensor.dtype} but the model was traced with "
                f"{self.dtypes[i]}, which torch.export fixes in the graph; pass "
                f"{self.dtypes[i]}, or convert the model and wrap it again with a sample of "
                "this dtype"
            )
        shape, dims = tuple(tensor.shape), self.dims[i]
        if len(shape) != len(dims):
            raise ValueError(
                f"input {name!r} has shape {_shape(shape)} but the model was traced at "
                f"{_shape(self.sample[i])}: pass a tensor of {len(dims)} dims"
            )
        fixed = [d for d, want in enumerate(dims) if isinstance(want, int)]
        if any(shape[d] != dims[d] for d in fixed):
            free = [d for d in range(1, len(dims)) if d not in fixed]
            which = ", ".join(["0 (the batch)", *map(str, free)])
            vary = [d for d in fixed if shape[d] != dims[d]]
            hint = vary[0] if len(vary) == 1 else vary
            raise ValueError(
                f"input {name!r} has shape {_shape(shape)} but the model was traced at "
                f"{_shape(self.sample[i])} with "
                + (f"dims {which} free" if free else "only the batch dimension free")
                + f"; pass dynamic={{{top!r}: {hint}}} to wrap() to let those sizes vary, "
                "or wrap the model again with this shape"
            )
        for d, want in enumerate(dims):
            if d == 0 or isinstance(want, int) or self.batch in want.free_symbols:
                continue
            if not want.is_Symbol:
                derived.append((want, shape[d], name, d))
            else:
                seen = values.setdefault(want, (shape[d], name, d))
                if seen[0] != shape[d]:
                    raise ValueError(
                        f"dim {d} of input {name!r} is {shape[d]} but dim {seen[2]} of input "
                        f"{seen[1]!r} is {seen[0]}; the traced graph needs them equal"
                    )

    def _check_guards(self, tensors: Sequence[Tensor]) -> None:
        assert self.guards is not None
        try:
            self.guards(*[tensors[i] for i in self.guard_inputs])
        except AssertionError as exc:
            text = str(exc).removeprefix("Guard failed: ")
            for i, placeholder in enumerate(self.placeholders):
                text = re.sub(rf"\b{re.escape(placeholder)}\b", repr(self.names[i][1]), text)
            raise ValueError(
                f"the inputs break a condition on shapes that the traced graph relies on "
                f"({text}; the model's code branched or reshaped on it); pass inputs that "
                "meet it or wrap the model again with such a sample"
            ) from None
