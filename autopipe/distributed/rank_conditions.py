"""The ranks' own conditions, measured on local ranks set up as the bench's are.

A rank of ``autopipe bench --ranks`` computes on its own share of the CPUs, with as many
threads, while its neighbours compute beside it (sharing the memory bus and the caches).
A profile made in one process with every core sees none of that. Here each rank, bound
as it will be when the splits run, profiles the whole model while the others do the
same, and the times of every unit are averaged over the ranks: each unit is timed with
the threads and binding of a rank and with every rank busy. The runner's own costs (a
message between neighbours, its fixed cost per stage and micro-batch) are timed on the
same ranks.
"""

from __future__ import annotations

import copy
import os
import statistics
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from autopipe.distributed.distributed_pipeline import init_distributed
from autopipe.distributed.local_ranks import (
    local_backend,
    report_to_launcher,
    run_on_local_ranks,
)
from profiler import Profile, store_calibration

__all__ = ["calibrate_local_ranks", "profile_on_local_ranks", "with_rank_times"]


def _join(rank: int, world: int, store: str, options: dict[str, Any]) -> None:
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    backend = options["backend"]
    init_distributed(
        backend,
        bind_cpus=backend == "gloo",
        timeout=timedelta(seconds=options["timeout"]),
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
    )


def _calibrate_main(
    rank: int, world: int, store: str, options: dict[str, Any], messages: Any
) -> None:
    """One rank of :func:`calibrate_local_ranks`: join the group as the bench's ranks do,
    time the links and the runner's fixed cost."""
    from autopipe.distributed.calibration import measure_p2p, measure_runner_overhead

    try:
        _join(rank, world, store, options)
        link = measure_p2p()
        schedule, virtual = options["schedule"], options["virtual_stages"]
        overhead = measure_runner_overhead(
            latency=link["latency_s"],
            schedule=schedule,
            virtual_stages=virtual,
            # A V schedule needs a micro-batch per stage (2K) at least.
            chunks=max(8, world * virtual),
        )
        values = {
            "latency_s": link["latency_s"],
            "bandwidth": link["bandwidth"],
            "overhead_s": overhead["overhead_s"],
            "threads": torch.get_num_threads(),
        }
        if virtual > 1 or schedule == "zb":  # torch's multi-stage runtime, priced apart
            values["virtual_overhead_s"] = overhead["overhead_s"]
        messages.put(("result", rank, values))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher as one line
        report_to_launcher(messages, rank, exc)


def calibrate_local_ranks(
    ranks: int,
    *,
    schedule: str = "1f1b",
    cuda: bool | None = None,
    timeout: float = 300.0,
    virtual_stages: int = 1,
) -> dict[str, Any]:
    """The runner's figures on ``ranks`` local processes, each set up as
    :func:`time_splits_on_ranks` sets up its ranks (gloo bound to its CPUs, or nccl).

    With ``virtual_stages`` above 1 (interleaved, or 2 for ``zbv`` and ``dualpipev``) or
    ``zb``, the tiny pipeline runs that many stages per rank under ``schedule`` on torch's
    multi-stage runtime, whose cost per operation is its own.

    Returns:
        ``latency_s``, ``bandwidth`` (of a message between neighbouring ranks),
        ``overhead_s`` (the runner's seconds per stage and micro-batch; on the multi-stage
        runtime also as ``virtual_overhead_s``, the figure plans of it use), ``threads``
        (each rank's torch threads) and ``backend``, as rank 0 measured them.

    Raises:
        RuntimeError: a rank failed; the message is its error.
    """
    options = {
        "backend": local_backend(ranks, cuda),
        "timeout": timeout,
        "schedule": schedule,
        "virtual_stages": virtual_stages,
    }
    values = dict(run_on_local_ranks(_calibrate_main, (options,), ranks, None)[0])
    values["backend"] = options["backend"]
    return values


def _profile_main(
    rank: int,
    world: int,
    store: str,
    build: Any,
    options: dict[str, Any],
    messages: Any,
) -> None:
    """One rank of :func:`profile_on_local_ranks`: profile the model, every rank at once."""
    from profiler import calibrate_in_step, profile_model

    try:
        _join(rank, world, store, options)
        torch.manual_seed(0)
        layers, sample = build()
        dist.barrier()  # every rank starts together, so each is timed with all busy
        found = profile_model(
            layers,
            sample,
            device="cpu" if options["backend"] == "gloo" else f"cuda:{rank}",
            chunks=options["chunks"],
            repeats=options["repeats"],
            warmup=options["warmup"],
        )
        scales = None
        if options.get("scale"):
            # Whole steps on every rank at once, each started together: the layers' cost
            # inside a step, with the other ranks busy as in training.
            found_scale = calibrate_in_step(
                found, layers, sample, chunks=options["chunks"], sync=dist.barrier
            )
            scales = [found_scale["fixed_scale"], found_scale["compute_scale"]]
        times = {
            "forward": [layer.forward for layer in found.layers],
            "backward": [layer.backward for layer in found.layers],
            "backward_input": [layer.backward_input for layer in found.layers],
            "batch_sizes": found.batch_sizes,
            "spread": found.meta.get("spread", 0.0),
            "threads": torch.get_num_threads(),
            "scales": scales,
        }
        dist.barrier()
        messages.put(("result", rank, times))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher as one line
        report_to_launcher(messages, rank, exc)


def profile_on_local_ranks(
    build: Any,
    ranks: int,
    *,
    chunks: int,
    repeats: int,
    warmup: int,
    cuda: bool | None = None,
    timeout: float = 600.0,
    scale: bool = False,
) -> list[dict[str, Any]]:
    """Each rank's layer times of the model, all ranks profiling at once.

    Args:
        build: what :func:`autopipe.distributed.rank_bench.time_splits_on_ranks` takes: makes
            the model's units and the mini-batch on every rank.
        ranks: the processes, set up as the bench's ranks (bound to their CPUs on gloo).
        chunks: micro-batches per step, which sets the profiled micro-batch sizes.
        repeats: timed runs per layer and size; their median is kept.
        warmup: untimed runs first.
        cuda: on GPUs with nccl, one per rank; default: when there are any.
        timeout: seconds a rank waits on another before failing.
        scale: also time whole steps of the model on every rank at once and fit the
            in-step scales (:func:`profiler.in_context.calibrate_in_step`).

    Returns:
        Per rank: ``forward``, ``backward``, ``backward_input`` (per layer, per batch
        size), ``batch_sizes``, ``spread`` (the profile's), ``threads`` and ``scales``
        (``[fixed_scale, compute_scale]``, or ``None`` without ``scale``).

    Raises:
        RuntimeError: a rank failed; the message is its error.
    """
    options = {
        "backend": local_backend(ranks, cuda),
        "timeout": timeout,
        "chunks": chunks,
        "repeats": repeats,
        "warmup": warmup,
        "scale": scale,
    }
    results = run_on_local_ranks(_profile_main, (build, options), ranks, None)
    return [results[rank] for rank in range(ranks)]


def with_rank_times(profile: Profile, measured: list[dict[str, Any]]) -> Profile:
    """A copy of ``profile`` whose layer times are the mean of the ranks' (bytes, names
    and everything else as they were), with the ranks' spread in ``meta``.

    Raises:
        ValueError: the ranks timed other layers or batch sizes than the profile holds.
    """
    for found in measured:
        if found["batch_sizes"] != profile.batch_sizes or len(found["forward"]) != len(
            profile.layers
        ):
            raise ValueError(
                "the ranks profiled other layers or micro-batch sizes than the model's "
                "profile; profile again"
            )
    timed = copy.deepcopy(profile)
    for index, layer in enumerate(timed.layers):
        for what in ("forward", "backward", "backward_input"):
            per_rank = [found[what][index] for found in measured]
            if any(values is None for values in per_rank):
                continue
            setattr(layer, what, [statistics.fmean(column) for column in zip(*per_rank)])
    timed.meta = dict(timed.meta)
    timed.meta["spread"] = statistics.fmean(found["spread"] for found in measured)
    scales = [found.get("scales") for found in measured]
    if all(scales):
        fixed, per_sample = (statistics.fmean(column) for column in zip(*scales))
        store_calibration(timed, fixed_scale=fixed, compute_scale=per_sample)
    timed.meta["profiled_on_ranks"] = {
        "ranks": len(measured),
        "threads": [found["threads"] for found in measured],
    }
    return timed
