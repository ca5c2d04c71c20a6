"""Times whole training steps of several splits of one model on local ranks it launches.

One process per pipeline position (holding its stage, or its stages: interleaved, or the
two of a V schedule) joins a process group (gloo on the CPU, each rank bound to its own
cores, :mod:`autopipe.distributed.cpu_binding`; nccl with one GPU per rank), builds the
model itself (``build``, a picklable function) and runs every split as a
:class:`autopipe.distributed.DistributedPipeline` of the given plan, the splits taking turns
one step each. A step is forward and backward through the pipeline with the loss the mean
of the output, then an SGD step of the rank's stage; its time is the slowest rank's, each
rank timing from a common barrier. With ``in_place`` the later warm-up steps
(:func:`autopipe.microbatching.step_timing.kept_warmup_rounds`, run among the timed ones:
:func:`~autopipe.microbatching.step_timing.turn_order`) are recorded in turn with
:class:`autopipe.distributed.step_trace.StepRecorder` and without it: every stage's forward
and backward per micro-batch (zero bubble's input and weight parts summed), timed on the
rank that runs it, and the whole step without the
recorder's cost, which ``autopipe bench`` predicts the timed steps from. After the timed
steps one untimed step per split counts the bytes each rank's stage saves for backward
(:class:`profiler.live_memory.SavedMemory`).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.distributed_pipeline import DistributedPipeline, init_distributed
from autopipe.distributed.local_ranks import (
    Progress,
    local_backend,
    report_to_launcher,
    run_on_local_ranks,
)
from autopipe.distributed.step_trace import StepRecorder, median_stage_seconds, stage_seconds
from autopipe.microbatching import (
    check_steps,
    kept_warmup_rounds,
    mean_output_loss,
    take_turns,
)
from autopipe.output import Measured, merge_stage_seconds
from autopipe.planning import Plan
from profiler import SavedMemory, synchronize

__all__ = ["time_splits_on_ranks"]

# Seconds any rank waits on another before failing: a hung rank fails the run.
TIMEOUT = 300.0

Build = Callable[[], tuple[nn.Sequential, Tensor | tuple[Tensor, ...]]]


def _loss(output: Any, target: Tensor) -> Tensor:
    """The benchmark's loss, which takes no target (:func:`mean_output_loss`)."""
    return mean_output_loss(output)


def _batch(sample: Tensor | tuple[Tensor, ...]) -> int:
    first = sample if isinstance(sample, Tensor) else sample[0]
    return int(first.shape[0])


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


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
                # K·v stages: interleaved, or a V schedule's 2 per rank.
                virtual_stages=max(plan.virtual_stages, 1),
            )
            optimizer = torch.optim.SGD(pipe.module.parameters(), lr=options["lr"])
            splits[label] = (pipe, optimizer)

        last_update = [0.0]  # this rank's optimizer step, of the last step

        def step(label: str) -> float:
            pipe, optimizer = splits[label]
            dist.barrier()
            start = time.perf_counter()
            pipe.step(sample, target)
            synchronize(device)
            stepped = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            last_update[0] = time.perf_counter() - stepped
            slowest = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            return float(slowest.item())

        def report(done: int, total: int, label: str) -> None:
            messages.put(("progress", done, total, label))

        records: dict[str, list[dict[str, Any]]] = {label: [] for label in splits}
        plain: dict[str, list[float]] = {label: [] for label in splits}
        kept_rounds = kept_warmup_rounds(options["warmup"])

        def warm_step(label: str, round_: int) -> float:
            """A warm-up step; in the later ones (the first sets up torch's stages) each
            stage's forwards and backwards are timed where they run, for the predictions,
            one in three: the two between run unrecorded and give the step's seconds
            without the recorder's own cost (a step of a shared host now and then takes
            twice as long: more of them, and a median, keep that out)."""
            if round_ not in kept_rounds or not options["in_place"]:
                return step(label)
            if (round_ - kept_rounds.start) % 3 != 0:
                seconds = step(label)
                plain[label].append(seconds)
                return seconds
            pipe = splits[label][0]
            with StepRecorder(pipe.stages, pipe.schedule, device, pipe.group) as recorder:
                seconds = step(label)
            found = stage_seconds(recorder.actions, seconds, recorder.stop)
            # The rank's one optimizer steps all its stages at once: each stage gets its
            # share by parameter bytes, which the update's fit is per byte of.
            sizes = {stage.stage_index: _param_bytes(stage.submod) for stage in pipe.stages}
            total = sum(sizes.get(index, 0) for index in found["stages"])
            for index, figures in found["stages"].items():
                share = sizes.get(index, 0) / total if total else 1 / len(found["stages"])
                figures["update"] = last_update[0] * share
            records[label].append(found)
            return seconds

        times = take_turns(
            list(splits),
            step,
            steps=options["steps"],
            warmup=options["warmup"],
            progress=report if rank == 0 else None,
            warmup_step=warm_step,
        )
        in_place = {label: median_stage_seconds(found) for label, found in records.items() if found}
        for label, found in in_place.items():
            if plain[label]:
                found["step"] = statistics.median(plain[label])
                found["steps"] = plain[label]
        peaks = {}
        for label, (pipe, _) in splits.items():
            with SavedMemory.of_modules(pipe.module) as saved:
                step(label)
            peaks[label] = saved.peak
        messages.put(("result", rank, {"times": times, "peaks": peaks, "in_place": in_place}))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the launcher as one line
        report_to_launcher(messages, rank, exc)


def time_splits_on_ranks(
    build: Build,
    plans: Mapping[str, Plan],
    *,
    ranks: int,
    steps: int,
    warmup: int = 1,
    lr: float = 1e-3,
    cuda: bool | None = None,
    progress: Progress | None = None,
    in_place: bool = False,
) -> dict[str, Measured]:
    """Times training steps of every plan's split on ``ranks`` local processes.

    Args:
        build: called on every rank (after pickling: a module-level function or a
            ``functools.partial`` of one) to make the model's units and the mini-batch
            every step trains on, as ``layers(*sample)`` takes it.
        plans: the splits by label, each of ``ranks`` stages, or ``ranks`` times its
            ``virtual_stages`` (interleaved, or 2 under the V schedules ``zbv`` and
            ``dualpipev``); each runs with its balance, micro-batches, schedule and
            checkpointing.
        ranks: the processes, one per pipeline position.
        steps: timed steps per split.
        warmup: untimed steps per split: the first ones first, the later ones among the
            timed steps (:func:`~autopipe.microbatching.step_timing.turn_order`).
        lr: the SGD learning rate.
        cuda: run on GPUs with nccl (one per rank), or on the CPU with gloo; default:
            on GPUs when there are any.
        progress: called with (steps done, steps in all, label) after every step.
        in_place: record the later warm-up steps (one in three; those between give the
            step's seconds) and return their medians per stage (``in_place`` of
            :class:`~autopipe.output.bench_summary.Measured`).

    Returns:
        Per label, the timed steps' seconds (the slowest rank's) and each rank's peak
        saved bytes (its stages together, where it holds several).

    Raises:
        ValueError: a plan not of ``ranks`` stages, fewer than one step, or not enough GPUs.
        RuntimeError: a rank failed; the message is its error.
    """
    check_steps(steps, warmup)
    for label, plan in plans.items():
        per_rank = max(plan.virtual_stages, 1)
        if plan.num_stages != ranks * per_rank:
            each = "one" if per_rank == 1 else str(per_rank)
            raise ValueError(
                f"the {label} split has {plan.num_stages} stages, not {each} per rank of {ranks}"
            )
    options = {
        "backend": local_backend(ranks, cuda),
        "timeout": TIMEOUT,
        "lr": lr,
        "steps": steps,
        "warmup": warmup,
        "in_place": in_place,
    }
    results = run_on_local_ranks(_rank_main, (build, dict(plans), options), ranks, progress)
    return {
        label: Measured(
            results[0]["times"][label],
            [results[r]["peaks"][label] for r in range(ranks)],
            merge_stage_seconds([results[r]["in_place"].get(label) for r in range(ranks)]),
        )
        for label in plans
    }
