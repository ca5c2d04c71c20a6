"""Times the whole model's training step against the sum of its layers' profiled times."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from scipy.optimize import nnls
from torch import Tensor, nn

from profiler.calibrate import store_calibration
from profiler.devices import synchronize
from profiler.layer import as_tensors
from profiler.layer_naming import layer_names, same_layer_name
from profiler.precision import autocast_pass
from profiler.profile import Profile
from profiler.samples import sample_arguments, sequential_inputs_problem

__all__ = ["calibrate_in_step", "measure_compute_scale"]

FIGURES = ("forward", "backward")


def _step(
    layers: Sequence[nn.Module],
    micro_batches: list[tuple[Tensor, ...]],
    device: torch.device,
    autocast: str | None = None,
    packed: bool = False,
) -> None:
    """Forward and backward of each micro-batch in turn, as a plain training loop does.

    The first layer takes the micro-batch's tensors as arguments (as one tuple when
    ``packed``), each later one the previous output as one value, as ``nn.Sequential``
    passes it. Under ``autocast`` each forward and backward runs in its own region, as
    the profile measured them.
    """
    for inputs in micro_batches:
        values: tuple[Tensor, ...] = tuple(
            t.detach().requires_grad_(t.is_floating_point()) for t in inputs
        )
        with autocast_pass(device.type, autocast):
            value: Any = layers[0](values) if packed else layers[0](*values)
            for layer in layers[1:]:
                value = layer(value)
            values = as_tensors(value, "a layer's output")
        targets = [t for t in values if t.requires_grad]
        if targets:
            with autocast_pass(device.type, autocast):
                torch.autograd.backward(targets, [torch.ones_like(t) for t in targets])


def _micro_batches(
    tensors: tuple[Tensor, ...], chunks: int, device: torch.device
) -> list[tuple[Tensor, ...]]:
    parts = zip(*(t.tensor_split(chunks) for t in tensors), strict=True)
    return [tuple(t.to(device) for t in part) for part in parts if part[0].shape[0] > 0]


def chunk_counts(batch: int, profiled: int) -> list[int]:
    """Micro-batch counts to time: the profile's, and powers of two up to 16 within the batch."""
    counts = {min(profiled, batch)}
    m = 1
    while m <= min(batch, 16):
        counts.add(m)
        m *= 2
    return sorted(counts)


def scale_counts(chunks: int) -> list[int]:
    """Two micro-batch counts around a run's ``chunks`` (it and half of it), the fewest
    whole steps that separate a per-micro-batch factor from a per-sample one."""
    return sorted({max(1, chunks // 2), chunks})


def calibrate_in_step(
    profile: Profile,
    model: nn.Sequential,
    sample: Tensor | tuple[Any, ...],
    *,
    chunks: int,
    repeats: int = 3,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Times whole steps of ``model`` at :func:`scale_counts` and stores the fitted
    ``fixed_scale`` and ``compute_scale`` in ``profile.meta["calibration"]``, which the
    planner applies to every layer's time.

    A layer timed alone over and over does not see what a step does to it: caches the
    other layers evicted (or, for a model that fits the cache, kept), the intra-op threads
    that slept between passes, the allocator's state. The whole step does; the fit puts
    the profile's sum on it, keeping each layer's share. It runs where the plan will run
    (in the process, or on every rank at once with ``sync``), which is what makes the
    prediction hold there.

    Returns:
        What :func:`measure_compute_scale` returns.
    """
    found = measure_compute_scale(
        model,
        sample,
        profile,
        chunks=scale_counts(chunks),
        repeats=repeats,
        warmup=warmup,
        sync=sync,
    )
    store_calibration(
        profile, fixed_scale=found["fixed_scale"], compute_scale=found["compute_scale"]
    )
    return found


def measure_compute_scale(
    model: nn.Sequential,
    sample: Tensor | tuple[Any, ...],
    profile: Profile,
    *,
    chunks: Sequence[int] | None = None,
    repeats: int = 10,
    warmup: int = 2,
    device: str | torch.device | None = None,
    sync: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """How much longer the model's layers take in a training step than the profile says.

    A profile times each layer alone, repeatedly, so its weights and inputs stay in
    cache; in a real step each layer finds them evicted by the layers before it. That
    mostly slows the part of a layer's time that does not grow with the batch (reading
    the weights, writing their gradients), so the two parts get their own factors: a copy
    of the model runs whole steps (forward then backward of each micro-batch, gradients
    reset between steps as an optimizer does) at several micro-batch counts M, and
    ``step(M) ≈ fixed_scale · Σ a · M + compute_scale · Σ b · batch`` is fitted over
    them, where every layer's profiled time is ``a + b · size``. The steps run under the
    profile's autocast (:attr:`Profile.autocast`), as its layers were measured.

    Args:
        model: the profiled model (left untouched: a copy runs).
        sample: the profiled mini-batch, as :func:`profiler.measure.profile_model` takes it.
        profile: its profile.
        chunks: the micro-batch counts to time (default: :func:`chunk_counts`).
        repeats: timed steps per count; the median is kept.
        warmup: untimed steps first.
        device: where to run (default: the profile's device).
        sync: called before every step, untimed; ranks measuring together pass a barrier,
            so that their steps overlap as in training.

    Returns:
        ``{"compute_scale": factor of per-sample time, "fixed_scale": factor of
        per-micro-batch time, "chunks": [...], "step_s": [...], "predicted_s": [...]}``
        (predicted: the profile's sums, unscaled).

    Raises:
        ValueError: the model does not match the profile, or bad counts.
    """
    if len(model) != len(profile):
        raise ValueError(f"the profile has {len(profile)} layers but the model has {len(model)}")
    named = zip(layer_names(model), model.children(), profile.layers)
    for i, (name, layer, seen) in enumerate(named):
        if not same_layer_name(seen.name, name) or type(layer).__name__ != seen.kind:
            raise ValueError(
                f"layer {i} is {name} ({type(layer).__name__}) in the model but "
                f"{seen.name} ({seen.kind}) in the profile: pass the profiled model"
            )
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    device = torch.device(profile.device if device is None else device)
    problem = sequential_inputs_problem(model, sample)
    if problem:
        raise ValueError(problem)
    tensors, packed = sample_arguments(sample)
    batch = tensors[0].shape[0]
    counts = chunk_counts(batch, profile.chunks) if chunks is None else sorted(set(chunks))
    runs = {m: _micro_batches(tensors, m, device) for m in counts}
    replica = copy.deepcopy(model).to(device)
    layers = list(replica)
    samples: dict[int, list[float]] = {m: [] for m in counts}
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        for i in range(warmup + repeats):
            for m in counts:  # round-robin: load changes hit every count alike
                replica.zero_grad(set_to_none=True)
                synchronize(device)
                if sync is not None:
                    sync()
                start = time.perf_counter()
                _step(layers, runs[m], device, profile.autocast, packed)
                synchronize(device)
                if i >= warmup:
                    samples[m].append(time.perf_counter() - start)
    del replica
    measured = [statistics.median(samples[m]) for m in counts]
    parts = [_parts(profile, [len(part[0]) for part in runs[m]]) for m in counts]
    fixed_scale, compute_scale = _fit_scales(parts, measured)
    return {
        "compute_scale": compute_scale,
        "fixed_scale": fixed_scale,
        "chunks": counts,
        "step_s": measured,
        "predicted_s": [a + b for a, b in parts],
    }


def _parts(profile: Profile, sizes: list[int]) -> tuple[float, float]:
    """The profile's per-micro-batch and per-sample seconds of micro-batches of ``sizes``.

    Each layer's time at a size lies on the segment between the measurements around it
    (:meth:`profiler.profile.Profile.segment`), ``a + b·size``: the ``a`` and the
    ``b·size`` are summed apart, as the two scales apply to them.
    """
    fixed = per_sample = 0.0
    for size in sizes:
        for i in range(len(profile)):
            for figure in FIGURES:
                a, b = profile.segment(i, figure, size)
                fixed, per_sample = fixed + a, per_sample + b * size
    return fixed, per_sample


def _fit_scales(parts: list[tuple[float, float]], measured: list[float]) -> tuple[float, float]:
    """Non-negative least squares, relative errors, of ``measured ≈ x·a + y·b``."""
    one = sum(measured) / max(sum(a + b for a, b in parts), 1e-30)
    if len(parts) < 2 or not all(a > 0 for a, _ in parts) or not all(b > 0 for _, b in parts):
        return one, one
    design = np.array(parts) / np.array(measured)[:, None]
    coef, _ = nnls(design, np.ones(len(parts)))
    if not (coef > 0).all():  # one part explains nothing: scale both alike
        return one, one
    return float(coef[0]), float(coef[1])
