"""Measures the executor's fixed overhead per stage and micro-batch, and stores calibrations.

Needs torch: import it only to calibrate (``autopipe calibrate``); planning reads the
stored figures from ``Profile.meta`` without it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autopipe.gpipe import GPipe
from autopipe.microbatching import median_seconds, tiny_stages
from autopipe.planning import gpipe_step_time, overhead_per_clock, unit_clocks
from profiler import (
    Profile,
    autocast_pass,
    check_autocast,
    gpu_count,
    measure_bandwidth,
    measure_compute_scale,
    stage_devices,
    store_calibration,
    synchronize,
)

__all__ = ["calibrate_executor"]


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in set(devices):
        synchronize(device)


def _stage_times(
    pipe: GPipe, batch: torch.Tensor, chunks: int, repeats: int, autocast: str | None
) -> list[float]:
    """Per partition, forward + backward seconds of one micro-batch run by hand."""
    inputs = batch.tensor_split(chunks)

    def timed(partition: nn.Module, device: torch.device) -> float:
        _synchronize(pipe.devices)
        start = time.perf_counter()
        for micro in inputs:
            x = micro.to(device).requires_grad_()
            with autocast_pass(device.type, autocast):
                y = partition(x).float().sum()
            y.backward()
        _synchronize(pipe.devices)
        return (time.perf_counter() - start) / chunks

    return [
        median_seconds(functools.partial(timed, partition, device), repeats, warmup=1)
        for partition, device in zip(pipe.partitions, pipe.devices)
    ]


def measure_overhead(
    devices: Sequence[str] = ("cpu", "cpu"),
    *,
    chunks: int = 8,
    width: int = 16,
    repeats: int = 10,
    warmup: int = 2,
    autocast: str | None = None,
) -> dict[str, Any]:
    """The GPipe executor's fixed seconds per stage and micro-batch.

    A tiny model (one ``Linear(width, width)`` per stage, one sample per micro-batch)
    runs a training step through :class:`GPipe` and, partition by partition, by hand. The
    planner predicts a step of ``Σ c_k + (M−1)·max c_k`` with ``c_k = w_k + o`` where
    ``w_k`` is the by-hand time; solving for ``o`` gives the overhead (at least 0).

    Args:
        devices: one device per stage (at least one).
        chunks: micro-batches M per step.
        width: features of the tiny model.
        repeats: timed steps; medians are kept.
        warmup: untimed steps first.
        autocast: run both under ``torch.autocast`` with this dtype, as the profile's
            layers were measured (the executor enters it on every stage).

    Returns:
        ``{"overhead_s": o, "step_s": GPipe's step, "stage_s": [w_k], "chunks": M}``.
    """
    if not devices or chunks < 1 or repeats < 1:
        raise ValueError("need at least one device, one micro-batch and one repeat")
    check_autocast(autocast)
    torch.manual_seed(0)
    k = len(devices)
    batch = torch.randn(chunks, width)
    with GPipe(
        tiny_stages(k, width), [1] * k, devices=list(devices), chunks=chunks, checkpoint="never"
    ) as pipe:

        def timed() -> float:
            _synchronize(pipe.devices)
            start = time.perf_counter()
            with autocast_pass(pipe.devices[0].type, autocast):
                out = pipe(batch).float().sum()
            out.backward()
            _synchronize(pipe.devices)
            return time.perf_counter() - start

        step = median_seconds(timed, repeats, warmup)
        stages = _stage_times(pipe, batch, chunks, repeats, autocast)
    predicted = gpipe_step_time(stages, chunks)
    overhead = overhead_per_clock(step, predicted, unit_clocks(k, chunks, "gpipe"))
    return {"overhead_s": overhead, "step_s": step, "stage_s": stages, "chunks": chunks}


def calibrate_executor(
    profile: Profile,
    devices: Sequence[str] | None = None,
    *,
    repeats: int = 10,
    model: nn.Sequential | None = None,
    sample: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
) -> dict[str, Any]:
    """Measures overhead and bandwidth on ``devices`` and stores them in the profile.

    Given the profiled model and sample, also times its whole training step against the
    profile and stores the ratio as ``compute_scale`` (see
    :func:`profiler.in_context.measure_compute_scale`). Everything runs under the
    profile's autocast (:attr:`Profile.autocast`).

    Args:
        profile: the profile to calibrate; ``profile.meta["calibration"]`` is updated.
        devices: the stage devices (default: two of the profile's device, or all visible
            GPUs for a CUDA profile). The bandwidth is measured from the first to the
            second (to itself with one device).
        repeats: timed repeats of each measurement.
        model: the profiled model (an ``nn.Sequential`` of the profile's layers), or ``None``.
        sample: the profiled mini-batch, with ``model``.

    Returns:
        The stored calibration.
    """
    if devices is None:
        if profile.device.startswith("cuda") and gpu_count():
            devices = [str(device) for device in stage_devices(gpu_count())]
        else:
            devices = [profile.device, profile.device]
    devices = list(devices)
    overhead = measure_overhead(devices, repeats=repeats, autocast=profile.autocast)
    link = measure_bandwidth(devices[0], devices[min(1, len(devices) - 1)], repeats=repeats)
    extra: dict[str, Any] = {}
    if model is not None:
        if sample is None:
            raise ValueError("calibrating the compute scale needs the sample with the model")
        scales = measure_compute_scale(model, sample, profile, repeats=repeats)
        extra = {key: scales[key] for key in ("compute_scale", "fixed_scale")}
    return store_calibration(
        profile,
        **extra,
        overhead_s=overhead["overhead_s"],
        bandwidth=link["bandwidth"],
        latency_s=link["latency_s"],
        devices=devices,
    )
