"""A device's achievable matmul FLOP/s and memory bandwidth, measured in a few seconds."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from profiler.devices import resolve_device, synchronize

__all__ = ["measure_peaks"]

# What a peak can be measured in; ``tf32`` is float32 matmuls on CUDA tensor cores.
PEAK_DTYPES = ("float32", "tf32", "bfloat16", "float16")
# Largest square matmul tried: enough to reach a GPU's peak, quick on a CPU.
_MAX_SIDE = {"cpu": 2048, "cuda": 8192}
# Bytes of the copy's source: well past the caches (a GPU's L2, a CPU's L3).
_COPY_BYTES = {"cpu": 128 * 2**20, "cuda": 1 << 30}
_TIMINGS = 7


def _rate(run: Callable[[], object], work: float, device: torch.device, budget: float) -> float:
    """The median of ``work`` per second over timings of ``run`` within ``budget`` seconds."""
    run()  # warm-up: allocations, kernel selection, thread start
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    once = max(time.perf_counter() - start, 1e-9)
    # Each timing repeats ``run`` so that it lasts long enough for the clock (GPU kernels
    # take microseconds) and the timings fill the budget.
    reps = max(1, int(budget / _TIMINGS / once))
    rates: list[float] = []
    deadline = time.perf_counter() + budget
    while len(rates) < 3 or (time.perf_counter() < deadline and len(rates) < 3 * _TIMINGS):
        start = time.perf_counter()
        for _ in range(reps):
            run()
        synchronize(device)
        rates.append(work * reps / max(time.perf_counter() - start, 1e-12))
    return statistics.median(rates)


def _matmul_rate(device: torch.device, dtype: str, budget: float) -> float:
    """FLOP/s of square matmuls, grown until one takes a fiftieth of the budget."""
    kind = torch.float32 if dtype == "tf32" else getattr(torch, dtype)
    side, cap = 256, _MAX_SIDE.get(device.type, 4096)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        while True:
            a = torch.randn(side, side, device=device).to(kind)
            b = torch.randn(side, side, device=device).to(kind)
            out = torch.empty(side, side, device=device, dtype=kind)
            torch.mm(a, b, out=out)
            synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            synchronize(device)
            if side >= cap or time.perf_counter() - start >= budget / 50:
                break
            side *= 2
        return _rate(lambda: torch.mm(a, b, out=out), 2.0 * side**3, device, budget)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _copy_rate(device: torch.device, budget: float) -> float:
    """Bytes read plus bytes written per second by a large copy."""
    size = _COPY_BYTES.get(device.type, 256 * 2**20)
    source = torch.ones(size // 4, device=device)
    target = torch.empty_like(source)
    return _rate(lambda: target.copy_(source), 2.0 * size, device, budget)


def _name_and_memory(device: torch.device) -> tuple[str, int]:
    if device.type == "cuda":
        found = torch.cuda.get_device_properties(device)
        return found.name, int(found.total_memory)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return _cpu_name() or device.type, int(memory)


def _cpu_name() -> str:
    """The processor's model name (``platform.processor()`` is empty on most Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def measure_peaks(
    device: torch.device | str = "cpu",
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    *,
    seconds: float = 2.0,
) -> dict[str, Any]:
    """Measures what a device achieves: matmul FLOP/s per dtype and memory bandwidth.

    The peaks are medians over repeated square matmuls (as large as the device needs, up
    to 8192 on a GPU and 2048 on a CPU); the bandwidth that of a copy past the caches,
    counting the bytes read and written. The result describes the device as the planner's
    catalog does (``autopipe.planning.hardware.device_catalog.measured_device`` takes it). Prints
    nothing.

    Args:
        device: the device, e.g. ``cpu`` or ``cuda:0``.
        dtypes: the dtypes to measure a peak in (see :data:`PEAK_DTYPES`).
        seconds: about how long the whole measurement takes.

    Returns:
        ``{"device": str, "name": str, "peak_flops": {dtype: FLOP/s},
        "memory_bandwidth": bytes/s, "memory": capacity in bytes}``.

    Raises:
        ValueError: an unknown dtype, ``tf32`` off CUDA, or ``seconds`` not > 0.
    """
    if not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"seconds is {seconds!r}; it must be a number > 0")
    dev = resolve_device(device)
    for dtype in dtypes:
        if dtype not in PEAK_DTYPES:
            raise ValueError(f"cannot measure a {dtype!r} peak; choose {', '.join(PEAK_DTYPES)}")
        if dtype == "tf32" and dev.type != "cuda":
            raise ValueError(f"tf32 is a CUDA tensor-core mode; {dev} has no tf32 peak")
    budget = float(seconds) / (len(dtypes) + 1)
    with torch.inference_mode():
        peaks = {dtype: _matmul_rate(dev, dtype, budget) for dtype in dtypes}
        bandwidth = _copy_rate(dev, budget)
    name, memory = _name_and_memory(dev)
    return {
        "device": str(dev),
        "name": name,
        "peak_flops": peaks,
        "memory_bandwidth": bandwidth,
        "memory": memory,
    }
