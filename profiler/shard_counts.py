"""What of a layer tensor and context parallelism divide, and what they communicate.

Counted with the layer's other figures (on fake tensors, so meta models work) when the
model comes with a tensor-parallel plan (module-name patterns mapped to styles, as a
Hugging Face config's ``base_model_tp_plan``). The planner derives from it each layer's
figures at any tensor-parallel degree ``t`` and context-parallel degree ``c``, so one
profile serves the whole mesh search.

Every list holds one figure per batch size of the profile, like the layer's own figures;
byte counts of communicated tensors are those of the whole (unsharded) tensor.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

__all__ = ["ShardCounts"]

_Record = TypeVar("_Record")


@dataclass
class ShardCounts:
    """One layer's parts that tensor and context parallelism divide.

    Attributes:
        flops: of the forward's FLOPs, those on tensors the tensor-parallel group shards
            (the sharded modules' matmuls and every operation between a column-wise and
            its row-wise module: attention on a share of the heads, the MLP's activation);
            ``t`` devices each run ``flops / t`` of them.
        backward_flops: the same for the backward.
        backward_input_flops: of ``backward_flops``, those of the input's gradient.
        traffic: of the forward's memory traffic, the sharded operations' bytes.
        backward_traffic: the same for the backward.
        saved: of the layer's saved bytes, those of sharded tensors.
        param_bytes: of the layer's parameter bytes, those the plan shards.
        reduce_forward: bytes of the tensors all-reduced in the forward (each row-wise
            module's output, whole; an ``*_rep``/gather style's all-gather counts here too).
        reduce_backward: bytes all-reduced in the backward (the gradient of each distinct
            input of the column-wise modules).
        reductions: collectives per forward (the same count runs in the backward).
        replicated_saved: of the layer's saved bytes, those of replicated activations that
            sequence parallelism divides by ``t`` (norms, residual sums, dropout masks).
        attention_flops: of the forward's FLOPs, those of attention's products
            (``scaled_dot_product_attention``, what context parallelism's ring overlaps).
        attention_backward_flops: the same for the backward.
        kv_bytes: bytes of the keys and values entering attention (whole), what the
            context-parallel ring passes around per attention call.
        attention_calls: attention calls per forward.
        heads: attention heads of the query, 0 without attention (the largest seen).
        kv_heads: attention heads of the keys and values (fewer under grouped queries).
    """

    flops: list[float]
    backward_flops: list[float]
    backward_input_flops: list[float]
    traffic: list[float]
    backward_traffic: list[float]
    saved: list[int]
    param_bytes: int
    reduce_forward: list[int]
    reduce_backward: list[int]
    reductions: int
    replicated_saved: list[int]
    attention_flops: list[float]
    attention_backward_flops: list[float]
    kv_bytes: list[int]
    attention_calls: int = 0
    heads: int = 0
    kv_heads: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object, where: str, n: int) -> ShardCounts:
        """Reads and validates one layer's record (``where`` names it, ``n`` batch sizes).

        Raises:
            ValueError: a field is missing, unknown, or not a finite figure >= 0 (one per
                batch size where it is a list).
        """
        made = read_record(cls, data, where)
        made.check(where, n)
        return made

    def check(self, where: str, n: int) -> None:
        """Every figure is finite and >= 0; lists hold one figure per batch size."""
        check_figures(self, where, n)


def read_record(cls: type[_Record], data: object, where: str) -> _Record:
    """A dataclass of per-layer counts from its JSON object (``where`` names it).

    Raises:
        ValueError: not an object, an unknown field, or a required one missing.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {data!r}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    for name in data:
        if name not in known:
            raise ValueError(f"{where} has unknown field {name!r}")
    try:
        return cls(**{k: data[k] for k in data})
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{where} is not valid: {exc}") from None


def check_figures(record: Any, where: str, n: int) -> None:
    """Every field of ``record`` is a finite number >= 0, a list one per batch size (``n``);
    an optional field (default ``None``) may be ``None``.

    Raises:
        ValueError: naming the field (and the batch size's index).
    """
    for f in fields(record):
        value = getattr(record, f.name)
        if value is None and f.default is None:  # an optional figure left out
            continue
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(
                    f"{where}.{f.name} must be a list of one figure per batch size ({n})"
                )
            items: Sequence[object] = value
        else:
            items = [value]
        for j, item in enumerate(items):
            number = float(item) if isinstance(item, numbers.Real) else math.nan
            if isinstance(item, bool) or not (math.isfinite(number) and number >= 0):
                at = f"[{j}]" if isinstance(value, list) else ""
                raise ValueError(
                    f"{where}.{f.name}{at} is {item!r}; it must be a finite number >= 0"
                )
