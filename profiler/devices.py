"""Which devices autopipe uses when none are given, and waiting for a device's work.

The one rule, for every entry point (profiling, the planner's command line, GPipe,
auto-wrapped pipelines, the distributed runner): when CUDA is available, work runs on GPUs
(one process: the current device; stage ``k`` of a pipeline: ``cuda:k mod G`` over the
``G`` visible GPUs, so that 4 stages on 2 GPUs share them round-robin), else on the CPU.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

__all__ = [
    "cpu_model",
    "default_device",
    "gpu_count",
    "physical_device",
    "resolve_device",
    "stage_devices",
    "synchronize",
]


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_count() -> int:
    """The number of visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_device() -> torch.device:
    """The current CUDA device when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stage_devices(count: int) -> list[torch.device]:
    """The devices of ``count`` pipeline stages: round-robin over the visible GPUs, else
    all on the CPU."""
    gpus = gpu_count()
    if gpus:
        return [torch.device("cuda", k % gpus) for k in range(count)]
    return [torch.device("cpu")] * count


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with an index: a bare ``cuda`` is the current CUDA device (``cuda:0``
    where CUDA is not available, so that names still compare)."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return resolved


def physical_device(device: torch.device | str | int) -> torch.device:
    """The physical device ``device`` names, so that two names of one device compare equal:
    ``cpu`` and ``cpu:0`` are the one CPU, ``cuda`` is the current CUDA device, an int is
    that CUDA device."""
    if isinstance(device, bool):  # an int to Python, never a device
        raise TypeError(f"a device is a name, a torch.device or a CUDA index, got {device!r}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    resolved = resolve_device(device)
    if resolved.type in ("cpu", "mps", "meta"):  # one device of the kind per process
        return torch.device(resolved.type)
    return resolved


def synchronize(device: torch.device) -> None:
    """Waits until the work queued on ``device`` is done (nothing to wait for on the CPU),
    so that a clock read afterwards includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
