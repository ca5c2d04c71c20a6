"""The calling thread's ``torch.autocast`` settings, captured to re-enter them elsewhere."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__: list[str] = []  # internal to the package

# The device types a pipeline runs on; autocast is per device type.
DEVICE_TYPES = ("cuda", "cpu")


class AutocastState:
    """The autocast regions the calling thread is in, per device type.

    Autocast is thread-local: a worker thread, and the autograd engine when it recomputes a
    checkpointed partition in backward (usually outside the caller's region), would
    otherwise compute in float32 what the first forward computed in half precision.
    """

    __slots__ = ("regions",)

    def __init__(self) -> None:
        self.regions = [
            (device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
            for device in DEVICE_TYPES
            if torch.is_autocast_enabled(device)
        ]

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Runs the block in the captured regions (and outside any other)."""
        with contextlib.ExitStack() as stack:
            for device in DEVICE_TYPES:
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            for device, dtype, cache in self.regions:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
            yield
