"""Times the whole model's training step against the sum of its layers' profiled times."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from profiler.layer import as_tensors
from profiler.profile import Profile

__all__ = ["measure_compute_scale", "predicted_compute"]


def predicted_compute(profile: Profile, sizes: Sequence[int]) -> float:
    """Σ over micro-batches and layers of the profile's forward + backward seconds."""
    return sum(
        profile.predict(i, "forward", size) + profile.predict(i, "backward", size)
        for size in sizes
        for i in range(len(profile))
    )


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(layers: Sequence[nn.Module], micro_batches: list[tuple[Tensor, ...]]) -> None:
    """Forward and backward of each micro-batch in turn, as a plain training loop does."""
    for inputs in micro_batches:
        values: tuple[Tensor, ...] = tuple(
            t.detach().requires_grad_(t.is_floating_point()) for t in inputs
        )
        for layer in layers:
            values = as_tensors(layer(*values), "a layer's output")
        targets = [t for t in values if t.requires_grad]
        if targets:
            torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])


def measure_compute_scale(
    model: nn.Sequential,
    sample: Tensor | tuple[Tensor, ...],
    profile: Profile,
    *,
    repeats: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    """How much longer the model's layers take in a training step than the profile says.

    A profile times each layer alone, repeatedly, so its weights and inputs stay in
    cache; in a real step each layer finds them evicted by the layers before it. A copy
    of the model runs whole steps on the profile's device (``profile.chunks``
    micro-batches, forward then backward each), and the ratio of their median to the
    profile's sum is the scale the planner applies to every layer's times.

    Args:
        model: the profiled model (left untouched: a copy runs).
        sample: the profiled mini-batch.
        profile: its profile.
        repeats: timed steps; the median is kept.
        warmup: untimed steps first.

    Returns:
        ``{"compute_scale": ratio, "step_s": measured, "predicted_s": the profile's sum}``.

    Raises:
        ValueError: the model does not match the profile, or bad counts.
    """
    if len(model) != len(profile):
        raise ValueError(f"the profile has {len(profile)} layers but the model has {len(model)}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    device = torch.device(profile.device)
    tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
    micro = [
        tuple(t.to(device) for t in chunk)
        for chunk in zip(*(t.tensor_split(profile.chunks) for t in tensors), strict=True)
        if chunk[0].shape[0] > 0
    ]
    replica = copy.deepcopy(model).to(device)
    layers = list(replica)
    samples = []
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for i in range(warmup + repeats):
            _synchronize(device)
            start = time.perf_counter()
            _step(layers, micro)
            _synchronize(device)
            if i >= warmup:
                samples.append(time.perf_counter() - start)
            replica.zero_grad(set_to_none=True)
    del replica
    measured = statistics.median(samples)
    predicted = predicted_compute(profile, [m[0].shape[0] for m in micro])
    scale = measured / predicted if predicted > 0 else 1.0
    return {"compute_scale": scale, "step_s": measured, "predicted_s": predicted}
