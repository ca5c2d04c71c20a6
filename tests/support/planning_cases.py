"""Shared builders of synthetic profiles and brute-force references for planner tests."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from profiler.profile import LayerProfile, Profile


def splits(n: int, stages: int) -> Iterator[list[int]]:
    """Every balance of ``n`` layers into ``stages`` non-empty stages."""
    for cuts in itertools.combinations(range(1, n), stages - 1):
        yield [b - a for a, b in itertools.pairwise((0, *cuts, n))]


def linear_profile(
    forward: list[float],
    backward: list[float] | None = None,
    saved: list[int] | None = None,
    output: list[int] | None = None,
    params: list[int] | None = None,
    *,
    batch: int = 8,
    chunks: int = 1,
    input_bytes: int = 0,
    peak: list[int] | None = None,
    shared: list[int] | None = None,
) -> Profile:
    """A profile whose figures are exactly proportional to the micro-batch size.

    Figures are given at ``micro = batch / chunks`` samples.
    """
    n = len(forward)
    backward = backward or [2 * f for f in forward]
    saved = saved or [0] * n
    output = output or [0] * n
    params = params or [0] * n
    micro = -(-batch // chunks)
    sizes = [1, 2] if micro == 1 else [micro // 2, micro] if micro % 2 == 0 else [1, micro]

    def at(value: float, size: int) -> float:
        return value * size / micro

    layers = [
        LayerProfile(
            name=f"l{i}",
            kind="Linear",
            forward=[at(forward[i], s) for s in sizes],
            backward=[at(backward[i], s) for s in sizes],
            saved=[round(at(saved[i], s)) for s in sizes],
            output=[round(at(output[i], s)) for s in sizes],
            param_bytes=params[i],
            peak=None if peak is None else [round(at(peak[i], s)) for s in sizes],
            shared=None if shared is None else [round(at(shared[i], s)) for s in sizes],
        )
        for i in range(n)
    ]
    return Profile(
        layers=layers,
        batch_sizes=sizes,
        input=[round(at(input_bytes, s)) for s in sizes],
        batch_size=batch,
        chunks=chunks,
    )


def random_profile(rng: np.random.Generator, n: int, *, peaks: bool = False) -> Profile:
    """A random profile with integer-valued figures (exact sums in float64).

    About half the layers share part of their saved bytes with the layer before (drawn
    last, so each seed gives the other figures it gave before shared bytes existed).
    """
    forward = [float(x) for x in rng.integers(1, 10, n)]
    backward = [float(x) for x in rng.integers(1, 10, n)]
    saved = [int(x) * 8 for x in rng.integers(0, 100, n)]
    output = [int(x) * 8 for x in rng.integers(1, 50, n)]
    params = [int(x) for x in rng.integers(0, 500, n)]
    peak = [int(x) * 8 for x in rng.integers(0, 40, n)] if peaks else None
    shared = [0] + [
        int(rng.integers(0, s // 8 + 1)) * 8 * int(rng.integers(0, 2)) for s in saved[1:]
    ]
    return linear_profile(
        forward=forward,
        backward=backward,
        saved=saved,
        output=output,
        params=params,
        batch=16,
        chunks=4,
        input_bytes=160,
        peak=peak,
        shared=shared,
    )


def uneven_profile(*, input_bytes: int = 0) -> Profile:
    """Eight layers of uneven times, saved and output bytes, 8 samples in 8 micro-batches:
    the V and zero-bubble schedules' re-computation cases."""
    return linear_profile(
        [1.0, 2, 1, 3, 1, 2, 1, 1],
        saved=[400, 900, 300, 800, 500, 700, 200, 600],
        output=[50, 120, 30, 90, 60, 80, 20, 10],
        params=[10] * 8,
        batch=8,
        chunks=8,
        input_bytes=input_bytes,
    )
