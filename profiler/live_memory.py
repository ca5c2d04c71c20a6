"""Tracks the bytes autograd holds for backward while code runs, and their peak.

CUDA has an allocator to ask for its peak; the CPU has none. What a pipeline stage holds
beyond its parameters is what autograd saves for backward, which
``saved_tensors_hooks`` sees on every device: each saved storage is counted once, from
the moment it is saved until the graph that holds it is freed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from profiler.layer import state_storages, storage_key

__all__ = ["SavedMemory"]


class _Held:
    """A saved tensor as autograd keeps it; releases its bytes when autograd drops it."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, owner: SavedMemory, key: int, tensor: Tensor) -> None:
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self) -> None:
        self.owner._release(self.key)


class SavedMemory:
    """Context manager counting live saved-for-backward bytes (per storage) and the peak.

    Use it around forward *and* backward of a step, on the thread that runs them::

        with SavedMemory(exclude=model.parameters()) as saved:
            model(x).sum().backward()
        saved.peak  # bytes

    Args:
        exclude: tensors whose storages are not counted (parameters and buffers, which
            the state memory already holds).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {storage_key(t)[0] for t in exclude}
        self._counts: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._lock = threading.Lock()
        self._hooks: Any = None
        self.live = 0
        self.peak = 0

    @classmethod
    def of_modules(cls, *modules: torch.nn.Module) -> SavedMemory:
        """A tracker excluding the modules' parameters and buffers."""
        tracker = cls()
        for module in modules:
            tracker._exclude |= state_storages(module)
        return tracker

    def reset_peak(self) -> None:
        """Starts a new peak from what is live now."""
        self.peak = self.live

    def _pack(self, tensor: Tensor) -> Any:
        key, nbytes = storage_key(tensor)
        if not nbytes or key in self._exclude:
            return tensor
        with self._lock:
            count = self._counts.get(key, 0)
            self._counts[key] = count + 1
            if count == 0:
                self._bytes[key] = nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return _Held(self, key, tensor)

    @staticmethod
    def _unpack(value: Any) -> Tensor:
        return value.tensor if isinstance(value, _Held) else value

    def _release(self, key: int) -> None:
        with self._lock:
            count = self._counts.get(key, 0) - 1
            if count > 0:
                self._counts[key] = count
                return
            self._counts.pop(key, None)
            self.live -= self._bytes.pop(key, 0)

    def __enter__(self) -> SavedMemory:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(kind, exc, traceback)
        self._hooks = None
