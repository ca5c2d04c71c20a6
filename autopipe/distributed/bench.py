"""Times whole training steps of several splits of one model on local ranks it launches.

One process per stage joins a process group (gloo on the CPU, each rank bound to its own
cores, :mod:`autopipe.distributed.cpu_binding`; nccl with one GPU per rank), builds the
model itself (``build``, a picklable function) and runs every split as a
:class:`autopipe.distributed.DistributedPipeline` of the given plan, the splits taking turns
one step each. A step is forward and backward through the pipeline with the loss the mean
of the output, then an SGD step of the rank's stage; its time is the slowest rank's, each
rank timing from a common barrier. After the timed steps one untimed step per split counts
the bytes each rank's stage saves for backward (:class:`profiler.live_memory.SavedMemory`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue as queues
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from autopipe.distributed.pipeline import DistributedPipeline, init_distributed
from autopipe.planning.bench_summary import Measured
from autopipe.planning.plans import Plan
from profiler.live_memory import SavedMemory

__all__ = ["calibrate_local_ranks", "time_splits_on_ranks"]

Build = Callable[[], tuple[nn.Sequential, Tensor | tuple[Tensor, ...]]]
Progress = Callable[[int, int, str], None]

# How long the other ranks get to report after one has failed, before they are ended.
_GRACE_S = 30.0


def _loss(output: Any, target: Tensor) -> Tensor:
    """The benchmark's loss: the mean of the output (its floating tensors' means summed)."""
    if isinstance(output, Tensor):
        return output.float().mean()
    tensors = [t for t in output if isinstance(t, Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError("the model's output holds no floating-point tensor to take a loss of")
    return torch.stack([t.float().mean() for t in tensors]).sum()


def _batch(sample: Tensor | tuple[Tensor, ...]) -> int:
    first = sample if isinstance(sample, Tensor) else sample[0]
    return int(first.shape[0])


def _rank_main(
    rank: int,
    world: int,
    store: str,
    build: Build,
    plans: dict[str, Plan],
    options: dict[str, Any],
    messages: Any,
) -> None:
    """One rank: join the group, build every split, time the turns, count saved bytes."""
    try:
        os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        backend = options["backend"]
        device = init_distributed(
            backend,
            bind_cpus=backend == "gloo",
            timeout=timedelta(seconds=options["timeout"]),
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
        )
        torch.manual_seed(0)
        layers, sample = build()
        target = torch.zeros(_batch(sample))
        splits = {}
        for label, plan in plans.items():
            pipe = DistributedPipeline(
                copy.deepcopy(layers),
                sample,
                loss_fn=_loss,
                chunks=plan.chunks,
                schedule=plan.schedule,
                plan=plan,
                device=device,
            )
            optimizer = torch.optim.SGD(pipe.module.parameters(), lr=options["lr"])
            splits[label] = (pipe, optimizer)

        def step(label: str) -> float:
            pipe, optimizer = splits[label]
            dist.barrier()
            start = time.perf_counter()
            pipe.step(sample, target)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            slowest = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            return float(slowest.item())

        warmup, steps = options["warmup"], options["steps"]
        times: dict[str, list[float]] = {label: [] for label in splits}
        total, done = (warmup + steps) * len(splits), 0
        for round_ in range(warmup + steps):
            for label in splits:
                seconds = step(label)
                if round_ >= warmup:
                    times[label].append(seconds)
                done += 1
                if rank == 0:
                    messages.put(("progress", done, total, label))
        peaks = {}
        for label, (pipe, _) in splits.items():
            with SavedMemory.of_modules(pipe.module) as saved:
                step(label)
            peaks[label] = saved.peak
        messages.put(("result", rank, {"times": times, "peaks": peaks}))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher as one line
        message = " ".join(str(exc).split())
        messages.put(("error", rank, f"{type(exc).__name__}: {message}"))
        raise SystemExit(1) from None


def _backend(ranks: int, cuda: bool | None) -> str:
    """nccl on GPUs (``cuda``; ``None``: when there are any), one per rank; else gloo."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        if torch.cuda.device_count() < ranks:
            raise ValueError(
                f"{ranks} ranks need {ranks} GPUs, and this host has "
                f"{torch.cuda.device_count()}; use {torch.cuda.device_count()} ranks or fewer"
            )
        return "nccl"
    return "gloo"


def time_splits_on_ranks(
    build: Build,
    plans: Mapping[str, Plan],
    *,
    ranks: int,
    steps: int,
    warmup: int = 1,
    lr: float = 1e-3,
    timeout: float = 300.0,
    cuda: bool | None = None,
    progress: Progress | None = None,
) -> dict[str, Measured]:
    """Times training steps of every plan's split on ``ranks`` local processes.

    Args:
        build: called on every rank (after pickling: a module-level function or a
            ``functools.partial`` of one) to make the model's units and the mini-batch
            every step trains on, as ``layers(*sample)`` takes it.
        plans: the splits by label, each of ``ranks`` stages; each runs with its
            balance, micro-batches, schedule and checkpointing.
        ranks: the processes, one per stage.
        steps: timed steps per split.
        warmup: untimed steps per split first.
        lr: the SGD learning rate.
        timeout: seconds any rank waits on another before failing.
        cuda: run on GPUs with nccl (one per rank), or on the CPU with gloo; default:
            on GPUs when there are any.
        progress: called with (steps done, steps in all, label) after every step.

    Returns:
        Per label, the timed steps' seconds (the slowest rank's) and each stage's peak
        saved bytes.

    Raises:
        ValueError: a plan not of ``ranks`` stages, fewer than one step, or not enough GPUs.
        RuntimeError: a rank failed; the message is its error.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need at least one timed step and no negative warm-up, got {steps}")
    for label, plan in plans.items():
        if plan.num_stages != ranks:
            raise ValueError(
                f"the {label} split has {plan.num_stages} stages, not one per rank of {ranks}"
            )
    options = {
        "backend": _backend(ranks, cuda),
        "timeout": timeout,
        "lr": lr,
        "steps": steps,
        "warmup": warmup,
    }
    results = _launch(_rank_main, (build, dict(plans), options), ranks, progress)
    return {
        label: Measured(
            results[0]["times"][label], [results[r]["peaks"][label] for r in range(ranks)]
        )
        for label in plans
    }


def _launch(
    target: Callable[..., None], args: tuple[Any, ...], ranks: int, progress: Progress | None
) -> dict[int, dict[str, Any]]:
    """Runs ``target(rank, world, store, *args, messages)`` on ``ranks`` new processes and
    returns each rank's result; a rank's failure is a ``RuntimeError`` naming it."""
    context = mp.get_context("spawn")
    messages = context.Queue()
    with tempfile.TemporaryDirectory(prefix="autopipe-bench-") as workdir:
        store = str(Path(workdir) / "store")
        procs = [
            context.Process(target=target, args=(rank, ranks, store, *args, messages), daemon=True)
            for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        results, error = _collect(procs, messages, progress)
    if error is not None:
        raise RuntimeError(error)
    return results


def _calibrate_main(
    rank: int, world: int, store: str, options: dict[str, Any], messages: Any
) -> None:
    """One rank of :func:`calibrate_local_ranks`: join the group as the bench's ranks do,
    time the links and the runner's fixed cost."""
    from autopipe.distributed.calibration import measure_p2p, measure_runner_overhead

    try:
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
        link = measure_p2p()
        overhead = measure_runner_overhead(latency=link["latency_s"], schedule=options["schedule"])
        values = {
            "latency_s": link["latency_s"],
            "bandwidth": link["bandwidth"],
            "overhead_s": overhead["overhead_s"],
            "threads": torch.get_num_threads(),
        }
        messages.put(("result", rank, values))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher as one line
        message = " ".join(str(exc).split())
        messages.put(("error", rank, f"{type(exc).__name__}: {message}"))
        raise SystemExit(1) from None


def calibrate_local_ranks(
    ranks: int, *, schedule: str = "1f1b", cuda: bool | None = None, timeout: float = 300.0
) -> dict[str, Any]:
    """The runner's figures on ``ranks`` local processes, each set up as
    :func:`time_splits_on_ranks` sets up its ranks (gloo bound to its CPUs, or nccl).

    Returns:
        ``latency_s``, ``bandwidth`` (of a message between neighbouring ranks),
        ``overhead_s`` (the runner's seconds per stage and micro-batch), ``threads`` (each
        rank's torch threads) and ``backend``, as rank 0 measured them.

    Raises:
        RuntimeError: a rank failed; the message is its error.
    """
    options = {"backend": _backend(ranks, cuda), "timeout": timeout, "schedule": schedule}
    values = dict(_launch(_calibrate_main, (options,), ranks, None)[0])
    values["backend"] = options["backend"]
    return values


def _collect(
    procs: list[Any], messages: Any, progress: Progress | None
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """The ranks' results, or the first error one reported, once every rank has ended."""
    results: dict[int, dict[str, Any]] = {}
    error: str | None = None
    failed_at: float | None = None

    def handle(message: tuple[Any, ...]) -> None:
        nonlocal error, failed_at
        kind = message[0]
        if kind == "progress" and progress is not None:
            progress(*message[1:])
        elif kind == "result":
            results[message[1]] = message[2]
        elif kind == "error" and error is None:
            error = f"rank {message[1]} failed: {message[2]}"
            failed_at = time.monotonic()

    while any(proc.is_alive() for proc in procs):
        with contextlib.suppress(queues.Empty):
            handle(messages.get(timeout=0.1))
        if failed_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            for proc in procs:  # ranks left waiting on the failed one
                if proc.is_alive():
                    proc.terminate()
    while True:
        try:
            handle(messages.get(timeout=0.5))
        except queues.Empty:
            break
    for proc in procs:
        proc.join()
    if error is None and len(results) < len(procs):
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))
        error = f"a rank ended without a result ({codes})"
    return results, error
