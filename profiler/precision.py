"""Mixed precision for profiling: the autocast dtype to measure under, and model casts.

torch is imported on first use, so :class:`profiler.profile.Profile` can validate its
``autocast`` field without it.

On the CPU, ``float16`` autocast runs most layers (linear, convolutions, attention,
normalization) in torch 2.x, but a few kernels have no CPU half-precision version (e.g.
``nn.LSTM``): profiling such a layer fails and names it. ``bfloat16`` is the CPU's
usual choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

__all__ = [
    "AUTOCAST_DTYPES",
    "DTYPES",
    "autocast_pass",
    "cast_model",
    "check_autocast",
    "check_dtype",
    "current_autocast",
]

# What ``torch.autocast`` computes in, on the CPU and on CUDA.
AUTOCAST_DTYPES = ("bfloat16", "float16")
# What a model's floating parameters can be cast to before profiling.
DTYPES = ("float32", "bfloat16", "float16")


def check_autocast(value: Any, what: str = "autocast") -> str | None:
    """``value`` if it is ``None`` or an autocast dtype name.

    Args:
        value: ``None``, ``"bfloat16"`` or ``"float16"``.
        what: how the message names the setting (``--autocast`` on the command line).

    Raises:
        ValueError: any other value.
    """
    if value is None or (isinstance(value, str) and value in AUTOCAST_DTYPES):
        return value
    raise ValueError(f"{what} must be {' or '.join(AUTOCAST_DTYPES)}, got {value!r}")


def check_dtype(value: Any, what: str = "dtype") -> str:
    """``value`` if it names a dtype in :data:`DTYPES`.

    Raises:
        ValueError: any other value.
    """
    if isinstance(value, str) and value in DTYPES:
        return value
    raise ValueError(f"{what} must be {', '.join(DTYPES[:-1])} or {DTYPES[-1]}, got {value!r}")


def current_autocast(device_type: str) -> str | None:
    """The autocast dtype the calling thread runs ``device_type`` under, if any."""
    import torch

    if not torch.is_autocast_enabled(device_type):
        return None
    name = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return name if name in AUTOCAST_DTYPES else None


@contextmanager
def autocast_pass(device_type: str, autocast: str | None) -> Iterator[None]:
    """One pass (a forward, or a backward) under ``autocast``; a no-op for ``None``.

    A training step casts the weights afresh in every autocast region (with GPipe, every
    micro-batch). Nested in a caller's region, leaving this one would keep the cast
    weights cached for the next pass, so the cache is cleared here.
    """
    if autocast is None:
        yield
        return
    import torch

    try:
        with torch.autocast(device_type, dtype=getattr(torch, autocast)):
            yield
    finally:
        torch.clear_autocast_cache()


def _cast(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def cast_model(
    model: nn.Module, sample: Tensor | tuple[Tensor, ...], dtype: str
) -> tuple[nn.Module, Tensor | tuple[Tensor, ...]]:
    """Casts the model's floating parameters and buffers, in place, and the sample's.

    Integer tensors (token ids, counters) keep their dtype.

    Args:
        model: the model; ``model.to(dtype)`` changes it in place.
        sample: a tensor or a tuple of tensors.
        dtype: a name in :data:`DTYPES`.

    Returns:
        The model and the cast sample, in the sample's form.

    Raises:
        ValueError: ``dtype`` is not in :data:`DTYPES`.
    """
    import torch

    target = getattr(torch, check_dtype(dtype))
    model.to(target)
    if isinstance(sample, tuple):
        return model, tuple(_cast(t, target) for t in sample)
    return model, _cast(sample, target)
