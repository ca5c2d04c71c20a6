"""Counted and measured profiles of one model, and where their bytes differ."""

from __future__ import annotations

from typing import Any

from torch import nn

from profiler.measure import profile_layers
from profiler.profile import Profile

__all__ = ["BYTE_FIELDS", "byte_differences", "counted_and_measured"]

# The per-layer byte figures a count must reproduce exactly.
BYTE_FIELDS = ("saved", "output", "shared", "param_bytes", "buffer_bytes")


def counted_and_measured(
    layers: nn.Sequential | list[nn.Module], sample: Any, **kwargs: Any
) -> tuple[Profile, Profile]:
    """The model's profile counted on fake tensors, and measured once per batch size."""
    names = [name for name, _ in layers.named_children()] if isinstance(layers, nn.Module) else None
    kwargs.setdefault("names", names)
    counted = profile_layers(list(layers), sample, measure=False, **kwargs)
    measured = profile_layers(list(layers), sample, warmup=0, repeats=1, **kwargs)
    return counted, measured


def byte_differences(counted: Profile, measured: Profile) -> dict[str, tuple[Any, Any]]:
    """``"layer.field"`` -> (counted, measured) for every byte figure that differs."""
    found: dict[str, tuple[Any, Any]] = {}
    if counted.input != measured.input:
        found["input"] = (counted.input, measured.input)
    assert [c.name for c in counted.layers] == [m.name for m in measured.layers]
    for ours, theirs in zip(counted.layers, measured.layers, strict=True):
        for field in BYTE_FIELDS:
            if getattr(ours, field) != getattr(theirs, field):
                found[f"{ours.name}.{field}"] = (getattr(ours, field), getattr(theirs, field))
    return found
