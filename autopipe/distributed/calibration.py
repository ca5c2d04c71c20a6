"""Measures the links between ranks and the runner's fixed cost, for the planner.

Run on every rank of an initialised process group (e.g. under ``torchrun``), once, before
planning: :func:`calibrate_ranks` times point-to-point messages between neighbouring
ranks (latency and bandwidth of a pipeline cut), an all-reduce (the data-parallel
gradient sync) and a tiny pipeline step (the schedule's fixed cost per stage and
micro-batch), and stores them in the profile the plan is made from, and the runner's
figures in this machine's calibration cache (:mod:`autopipe.distributed.calibration_cache`)
for every later plan of the same runtime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopipe.distributed.calibration_cache import current_runtime_key, save_runner_calibration
from autopipe.distributed.collectives import rank_device, share_from_rank0
from autopipe.distributed.replicas import all_reduce_mean
from autopipe.distributed.runner import PipelineRunner
from autopipe.microbatching import median_seconds, tiny_stages
from autopipe.planning import overhead_per_clock, unit_clocks
from profiler import Profile, fit_linear, measure_compute_scale, store_calibration, synchronize

__all__ = ["calibrate_ranks"]

P2P_SIZES = (4 << 10, 64 << 10, 1 << 20)
ALLREDUCE_SIZES = (32 << 20,)


def slowest_seconds(function: Callable[[], Any], group: dist.ProcessGroup | None = None) -> float:
    """Seconds ``function()`` takes on the slowest rank, all ranks starting together.

    A collective: every rank of ``group`` calls it, each with its part of the work.
    """
    device = rank_device(group)
    dist.barrier(group=group)
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
    return took.item()


def measure_p2p(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = P2P_SIZES,
    repeats: int = 20,
    warmup: int = 3,
) -> dict[str, Any]:
    """One-way message time between group ranks 0 and 1, fitted as latency + bytes / bw.

    Ranks 0 and 1 bounce a tensor back and forth (half a round trip is one message);
    other ranks only join the final agreement. A collective: call it on every rank.

    Returns:
        ``{"latency_s": s, "bandwidth": bytes/s, "sizes": [...], "times": [...]}``, the
        same on every rank.
    """
    rank, device = dist.get_rank(group), rank_device(group)
    peer = 1 - rank
    times = []
    for size in sizes:
        data = torch.zeros(max(size // 4, 1), device=device)
        samples = []
        for i in range(warmup + repeats):
            if rank > 1:
                break
            synchronize(device)
            start = time.perf_counter()
            target = dist.get_global_rank(group or dist.group.WORLD, peer)  # type: ignore[arg-type]
            if rank == 0:
                dist.send(data, target, group=group)
                dist.recv(data, target, group=group)
            else:
                dist.recv(data, target, group=group)
                dist.send(data, target, group=group)
            synchronize(device)
            if i >= warmup:
                samples.append((time.perf_counter() - start) / 2)
        times.append(statistics.median(samples) if samples else 0.0)

    def fit() -> dict[str, Any]:  # rank 0's times: ranks 0 and 1 exchanged the messages
        nbytes = [max(s // 4, 1) * 4 for s in sizes]
        latency, per_byte = fit_linear(nbytes, times)
        bandwidth = 1.0 / per_byte if per_byte > 0 else nbytes[-1] / times[-1]
        return {"latency_s": latency, "bandwidth": bandwidth, "sizes": nbytes, "times": times}

    what, failed = "receive the link times from rank 0", "rank 0 could not fit the link times"
    return dict(share_from_rank0(fit, group, what=what, failed=failed))


def measure_allreduce(
    group: dist.ProcessGroup | None = None,
    *,
    sizes: Sequence[int] = ALLREDUCE_SIZES,
    repeats: int = 10,
    warmup: int = 2,
) -> dict[str, Any]:
    """The gradient-averaging bandwidth of the group, in the planner's ring terms.

    Times what the replicas do after a step:
    :func:`autopipe.distributed.replicas.all_reduce_mean` of
    a stage's gradients (several tensors, bucketed into flat buffers), here tensors of
    the largest size in all. The planner charges ``2·(D−1)/D · bytes / bandwidth``; the
    bandwidth reported makes this match the slowest rank's median.
    """
    device, world = rank_device(group), dist.get_world_size(group)
    size = max(sizes)
    grads = [torch.ones(size // 32, device=device) for _ in range(8)]
    everyone = group or dist.group.WORLD

    def average() -> None:
        all_reduce_mean(grads, everyone, world)  # type: ignore[arg-type]

    seconds = median_seconds(lambda: slowest_seconds(average, group), repeats, warmup)
    factor = 2.0 * (world - 1) / world if world > 1 else 1.0
    return {"allreduce_bandwidth": factor * size / seconds, "allreduce_s": seconds, "bytes": size}


def measure_runner_overhead(
    group: dist.ProcessGroup | None = None,
    *,
    chunks: int = 8,
    width: int = 8,
    repeats: int = 10,
    warmup: int = 2,
    schedule: str = "1f1b",
    latency: float = 0.0,
    virtual_stages: int = 1,
) -> dict[str, Any]:
    """The distributed runner's fixed seconds per stage and micro-batch.

    A tiny model (one ``Linear(width, width)`` per stage, one sample per micro-batch) runs
    steps of :class:`autopipe.distributed.DistributedPipeline` (as
    :class:`~autopipe.distributed.runner.PipelineRunner`) with the given schedule and
    virtual stages per rank. Its compute is negligible, so every stage costs ``o + λ`` per
    micro-batch, and the planner's step for it is that times the clocks of the schedule
    (``M + K − 1`` for one stage per rank; for virtual stages the replayed schedule of
    equal stages, ``v·M + K − 1`` when M ≥ K), which gives ``o``. Torch runs virtual
    stages on another runtime than one stage per rank, with its own cost per operation.
    """
    ranks = dist.get_world_size(group)
    stages = ranks * virtual_stages
    torch.manual_seed(0)
    x, y = torch.randn(chunks, width), torch.zeros(chunks, width)
    pipe = PipelineRunner(
        tiny_stages(stages, width),
        x,
        loss_fn=lambda out, _: out.sum(),
        chunks=chunks,
        schedule=schedule,
        group=group,
        virtual_stages=virtual_stages,
        checkpoint="never",  # the executor's own cost, no re-computation
    )
    step = median_seconds(lambda: slowest_seconds(lambda: pipe.step(x, y), group), repeats, warmup)
    clocks = unit_clocks(ranks, chunks, schedule, virtual_stages)
    # The compute is negligible: each clock is one message's latency and ``o``.
    hops = latency if ranks > 1 else 0.0
    return {
        "overhead_s": overhead_per_clock(step, hops * clocks, clocks),
        "step_s": step,
        "chunks": chunks,
        "clocks": clocks,
        "virtual_stages": virtual_stages,
        "schedule": schedule,
    }


def measure_compute_together(
    model: nn.Sequential,
    sample: torch.Tensor | tuple[torch.Tensor, ...],
    profile: Profile,
    group: dist.ProcessGroup | None = None,
    *,
    repeats: int = 5,
) -> dict[str, float]:
    """The compute scales of :func:`profiler.in_context.measure_compute_scale`, measured
    on every rank at once and averaged, and on rank 0 alone.

    Ranks that share a host (CPU sockets, memory bandwidth, a GPU's host) slow each other
    down; timing them together, every step started on all ranks at once, puts that in the
    scale, as it will be in training. A
    configuration on a single device runs without that competition: it gets the scales
    of rank 0 alone (``alone_fixed_scale``, ``alone_compute_scale``).
    """
    device = rank_device(group)
    dist.barrier(group=group)
    # Every step starts together on every rank, so that each is timed with all busy.
    barrier = lambda: dist.barrier(group=group)  # noqa: E731
    found = measure_compute_scale(
        model, sample, profile, repeats=repeats, device=device, sync=barrier
    )
    scales = torch.tensor([found["fixed_scale"], found["compute_scale"]], dtype=torch.float64)
    dist.all_reduce(scales, group=group)
    scales /= dist.get_world_size(group)

    # One rank alone, the others waiting: what a configuration on one device sees.
    def single() -> tuple[float, float]:
        found = measure_compute_scale(model, sample, profile, repeats=repeats, device=device)
        return found["fixed_scale"], found["compute_scale"]

    what, failed = "receive rank 0's compute scales", "rank 0 could not time the model alone"
    alone = share_from_rank0(single, group, what=what, failed=failed)
    return {
        "fixed_scale": scales[0].item(),
        "compute_scale": scales[1].item(),
        "alone_fixed_scale": float(alone[0]),
        "alone_compute_scale": float(alone[1]),
    }


def calibrate_ranks(
    profile: Profile,
    group: dist.ProcessGroup | None = None,
    *,
    repeats: int = 20,
    model: nn.Sequential | None = None,
    sample: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    virtual_stages: int = 1,
    schedule: str = "1f1b",
) -> dict[str, Any]:
    """Measures links, all-reduce and runner overhead; stores them in ``profile`` (every rank).

    Args:
        profile: the profile to plan from; the same calibration is stored on every rank.
        group: the ranks (default: the world).
        repeats: timed repeats of each measurement.
        model: the profiled model (its layers as an ``nn.Sequential``): also measure the
            compute scales with every rank computing at once.
        sample: the profiled mini-batch, with ``model``.
        virtual_stages: with more than 1 (or ``schedule="zb"``), also measure the runner's
            overhead with that many stages per rank under ``schedule`` (torch runs them on
            another runtime, whose cost per operation differs), stored as
            ``virtual_overhead_s`` for plans with virtual stages or zero bubble.
        schedule: ``1f1b``, ``gpipe`` or ``zb``, for ``virtual_stages``.

    Returns:
        The stored calibration (``latency_s``, ``bandwidth``, ``overhead_s``,
        ``allreduce_bandwidth``, with a model ``compute_scale`` and ``fixed_scale``, with
        virtual stages ``virtual_overhead_s``).
    """
    link = measure_p2p(group, repeats=repeats)
    reduce = measure_allreduce(group, repeats=max(repeats // 2, 3))
    overhead = measure_runner_overhead(group, latency=link["latency_s"])
    extra: dict[str, Any] = {}
    if virtual_stages > 1 or schedule == "zb":  # torch's multi-stage runtime
        virtual = measure_runner_overhead(
            group, latency=link["latency_s"], virtual_stages=virtual_stages, schedule=schedule
        )
        extra["virtual_overhead_s"] = virtual["overhead_s"]
    if model is not None:
        if sample is None:
            raise ValueError("calibrating the compute scale needs the sample with the model")
        extra.update(
            measure_compute_together(model, sample, profile, group, repeats=repeats // 4 + 2)
        )
    stored = store_calibration(
        profile,
        latency_s=link["latency_s"],
        bandwidth=link["bandwidth"],
        allreduce_bandwidth=reduce["allreduce_bandwidth"],
        overhead_s=overhead["overhead_s"],
        **extra,
    )
    if dist.get_rank(group) == 0:  # every later plan for this runner starts from it
        ranks = dist.get_world_size(group)
        save_runner_calibration(current_runtime_key(ranks), stored)
        if "virtual_overhead_s" in extra:
            save_runner_calibration(
                current_runtime_key(ranks, schedule, virtual_stages),
                {**stored, "overhead_s": extra["virtual_overhead_s"]},
            )
    return stored
