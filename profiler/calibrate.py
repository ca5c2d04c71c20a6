"""Measures the link bandwidth between two devices, for the planner's transfer costs.

torch is imported on first use, so :func:`store_calibration` works without it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from profiler.fit import fit_linear
from profiler.profile import Profile

__all__ = ["measure_bandwidth", "store_calibration"]

# Copy sizes in bytes: large enough that the per-copy latency does not dominate.
DEFAULT_SIZES = (1 << 20, 4 << 20, 16 << 20)


def measure_bandwidth(
    source: str = "cpu",
    target: str = "cpu",
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    warmup: int = 1,
) -> dict[str, Any]:
    """Times copies of float32 tensors from ``source`` to ``target`` at a few sizes.

    The medians are fitted as ``time = latency + bytes / bandwidth``. On a CPU both
    devices may be ``cpu``: the copy then measures memory bandwidth.

    Args:
        source: the device the tensor starts on, e.g. ``cuda:0``.
        target: the device it is copied to, e.g. ``cuda:1``.
        sizes: bytes per copy.
        repeats: timed copies per size; the median is kept.
        warmup: untimed copies per size first.

    Returns:
        ``{"bandwidth": bytes/s, "latency_s": s, "sizes": [...], "times": [...]}``.

    Raises:
        ValueError: no sizes, or fewer than one repeat.
    """
    import torch

    from profiler.devices import synchronize

    if not sizes or repeats < 1:
        raise ValueError("need at least one size and one repeat")
    src, dst = torch.device(source), torch.device(target)
    times = []
    for size in sizes:
        count = max(int(size) // 4, 1)
        data = torch.ones(count, dtype=torch.float32, device=src)
        out = torch.empty(count, dtype=torch.float32, device=dst)
        samples = []
        for i in range(warmup + repeats):
            synchronize(src)
            synchronize(dst)
            start = time.perf_counter()
            out.copy_(data)
            synchronize(dst)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    nbytes = [max(int(size) // 4, 1) * 4 for size in sizes]
    latency, per_byte = fit_linear(nbytes, times)
    if per_byte <= 0:  # all copies took the same time: use the largest's average rate
        per_byte, latency = times[-1] / nbytes[-1], 0.0
    return {"bandwidth": 1.0 / per_byte, "latency_s": latency, "sizes": nbytes, "times": times}


def store_calibration(profile: Profile, **values: Any) -> dict[str, Any]:
    """Merges measured values into ``profile.meta["calibration"]`` and returns it.

    The planner reads ``overhead_s`` (seconds per stage and micro-batch) and
    ``bandwidth`` (bytes/s) from there; other keys are kept for reference.
    """
    found = profile.meta.get("calibration")
    merged = dict(found) if isinstance(found, dict) else {}
    merged.update(values)
    profile.meta["calibration"] = merged
    return merged
