"""Refuses to measure a layer whose counted bytes do not fit the device's free memory.

Measuring gives a layer real storage: a model on the meta device is materialized one
layer at a time, and a real model's layer is copied to the device. A layer larger than
the free memory would push the host into swap or the out-of-memory killer (or fail deep
inside a CUDA kernel) long after the count pass knew its size. The count pass runs first
on fake tensors, so its bytes are compared with what the device has free before any
layer is materialized.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from profiler.counting import LayerCounts

__all__ = ["MemoryShortage", "format_bytes", "storage_shortage"]

# Of the free memory, the share a measured layer's counted bytes may take: the rest is for
# what counting does not see (kernel workspaces, the allocator's rounding, the process).
USABLE_SHARE = 0.8


class MemoryShortage(ValueError):
    """A layer needs more memory to be measured than the device has free.

    Attributes:
        label: the layer, e.g. ``layer 3 (Linear)``.
        needed: the counted bytes measuring it takes.
        free: the device's free bytes.
        device: the device.
        detail: what the needed bytes are made of.
    """

    def __init__(self, label: str, needed: int, free: int, device: str, detail: str) -> None:
        self.label, self.needed, self.free = label, needed, free
        self.device, self.detail = device, detail
        super().__init__(
            f"{self.shortage()}; count the layers instead of measuring them "
            "(profile_layers(..., measure=False)) or profile a smaller sample"
        )

    def shortage(self) -> str:
        """What is short, without advice on what to do."""
        where = "the host" if self.device == "cpu" else self.device
        spare = round(100 * (1 - USABLE_SHARE))
        return (
            f"measuring {self.label} needs {format_bytes(self.needed)} ({self.detail}) but "
            f"{where} has {format_bytes(self.free)} free, of which {spare}% stays spare"
        )


def format_bytes(count: float) -> str:
    """``count`` bytes in binary units, e.g. ``12.00 GiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def _cgroup_available() -> int | None:
    """What the process's memory cgroup still allows, if it sets a limit (containers)."""
    pairs = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    )
    for limit_file, usage_file in pairs:
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit == "max":
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text().strip()))
    return None


def _address_space_left() -> int | None:
    """What the process's address-space limit (``ulimit -v``) still allows, if it has one."""
    with contextlib.suppress(ImportError, OSError, ValueError):
        import resource

        limit, _ = resource.getrlimit(resource.RLIMIT_AS)
        if limit == resource.RLIM_INFINITY:
            return None
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, limit - int(line.split()[1]) * 1024)
    return None


def free_bytes(device: torch.device) -> int | None:
    """The bytes ``device`` can still allocate, or ``None`` where that cannot be read.

    On CUDA: the device's free memory plus what torch's caching allocator holds unused.
    On the CPU: the host's available memory, or less where a memory cgroup or an
    address-space limit (``ulimit -v``) limits the process.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + max(0, cached))
    if device.type != "cpu":
        return None
    limits = (_meminfo_available(), _cgroup_available(), _address_space_left())
    found = [n for n in limits if n is not None]
    return min(found) if found else None


def measuring_bytes(
    layer: nn.Module, counts: Sequence[LayerCounts] | None, inputs: Sequence[int]
) -> tuple[int, str]:
    """The bytes measuring ``layer`` holds at once, by its counts, and what they are.

    Its parameters and buffers; two gradients of each trainable parameter (the one
    accumulated and the next backward's before it is added); the inputs and outputs at
    every batch size (the next layer's inputs are computed before these are freed); and at
    the largest size the copy of the input each pass takes, its gradient, the saved
    activations and the output's gradient.

    Args:
        layer: the layer, on any device (the meta device included).
        counts: its counts at each batch size; ``None``: not counted, the state alone.
        inputs: the bytes of its input at each batch size.
    """
    state = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
    grads = 2 * sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    parts = [f"parameters and buffers {format_bytes(state)}"]
    if grads:
        parts.append(f"gradients {format_bytes(grads)}")
    if not counts:
        return state + grads, ", ".join(parts)
    held = sum(inputs) + sum(c.output for c in counts)
    largest = max(
        2 * x + c.saved - c.input_saved + 2 * c.output for c, x in zip(counts, inputs, strict=True)
    )
    parts.append(f"activations {format_bytes(held + largest)}")
    return state + grads + held + largest, ", ".join(parts)


def check_fits(label: str, needed: int, detail: str, device: torch.device) -> None:
    """Refuses to measure a layer of ``needed`` bytes that ``device`` cannot hold.

    Raises:
        MemoryShortage: ``needed`` exceeds :data:`USABLE_SHARE` of the free memory.
    """
    free = free_bytes(device)
    if free is not None and needed > USABLE_SHARE * free:
        raise MemoryShortage(label, needed, free, str(device), detail)


def storage_shortage(needed: int, device: torch.device | str) -> str | None:
    """What is short when ``needed`` bytes are to be given storage on ``device`` at once,
    or ``None`` when they fit :data:`USABLE_SHARE` of its free memory (or it cannot be
    read): e.g. ``needs 12.00 GiB but the host has 8.00 GiB free, of which 20% stays spare``.
    """
    device = torch.device(device)
    free = free_bytes(device)
    if free is None or needed <= USABLE_SHARE * free:
        return None
    where = "the host" if device.type == "cpu" else str(device)
    spare = round(100 * (1 - USABLE_SHARE))
    return (
        f"needs {format_bytes(needed)} but {where} has {format_bytes(free)} free, of which "
        f"{spare}% stays spare"
    )
