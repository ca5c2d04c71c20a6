"""The ``autopipe bench`` command: train every split of a model for a few steps and compare."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopipe import PlanningError
from autopipe.cli.bench_conditions import (
    calibrate_runner,
    fit_in_place,
    profile_as_run,
    replan,
)
from autopipe.cli.bench_options import (
    add_bench_arguments,
    check_chunks,
    given_balance,
    gpipe_devices,
    stages_per_rank,
    strategy_names,
)
from autopipe.cli.model_output import model_output_to_stderr
from autopipe.cli.options import cost_options, default_device, default_stages
from autopipe.planning import V_SCHEDULES, PipelineSettings

if TYPE_CHECKING:
    from torch import Tensor, nn

    from autopipe.output import Measured
    from autopipe.planning import Plan
    from profiler import Profile

__all__: list[str] = []  # internal to the command line

# What the prediction came from when the first run's figures chose a split not yet run.
_SECOND_RUN = "in-place figures of a second run (the first run's chose another split)"

GIVEN = "given"  # the label of the --balance split
LOSS = "mean of the output"
LR = 1e-3  # the SGD learning rate of the benchmark's steps


def add_bench_parser(commands: Any, epilog: str) -> None:
    """``autopipe bench``."""
    parser = commands.add_parser(
        "bench",
        help="train every balance strategy's split for a few steps and compare the times",
        description="Profile MODEL.py (or load --profile FILE), split it into --stages "
        "stages with every --strategies strategy (and --balance), run whole training steps "
        "of each split (forward, the loss: the mean of the output, backward, an SGD step) "
        "on the single-process GPipe or, with --ranks, on local distributed ranks, the "
        "splits taking turns, and print each split's measured step against its prediction "
        "and the ideal balanced bound.",
        epilog=epilog,
    )
    add_bench_arguments(parser)
    parser.set_defaults(func=bench_command)


def load_units(
    path: str, dtype: str | None, granularity: str | None, leaf_modules: Iterable[str]
) -> tuple[nn.Sequential, Tensor | tuple[Tensor, ...]]:
    """The model file's units and sample, as profiled; what every rank builds."""
    from autopipe.cli.model_file import load_split

    _, layers, sample = load_split(
        path, dtype, granularity=granularity, leaf_modules=list(leaf_modules)
    )
    return layers, sample


def _plans(
    profile: Profile,
    devices: int | list[str],
    names: list[str],
    balance: list[int] | None,
    options: Any,
    chosen: bool = True,
) -> dict[str, Plan]:
    """Every strategy's plan, then the given balance's; a split that does not fit is an error.

    Unless the strategies were ``chosen`` by name, ``torchtitan`` is left out of a model
    without its shape (it places an embedding, decoder layers and an output).
    """
    from autopipe.planning import evaluate, format_bytes, has_titan_shape, plan

    if not chosen and not has_titan_shape([layer.name for layer in profile.layers]):
        names = [name for name in names if name != "torchtitan"]
    plans = {name: plan(profile, devices, strategy=name, **options) for name in names}
    if balance is not None:
        given = evaluate(profile, balance, devices, strategy=GIVEN, **options)
        for stage in given.stages:
            if stage.capacity is not None and stage.memory > stage.capacity:
                raise PlanningError(
                    f"the --balance split {balance} does not fit: stage {stage.index} needs "
                    f"{format_bytes(stage.memory)}, more than its "
                    f"{format_bytes(stage.capacity)}; give another --balance or more --memory"
                )
        plans[GIVEN] = given
    return plans


class _Progress:
    """The steps done, on stderr: one line rewritten on a terminal, else a line a round."""

    def __init__(self, splits: int) -> None:
        self.splits = splits

    def __call__(self, done: int, total: int, label: str) -> None:
        stream = sys.stderr
        line = f"training step {done}/{total} ({label})"
        if stream.isatty():
            stream.write("\r" + line.ljust(60) + ("\n" if done >= total else ""))
        elif done % self.splits == 0 or done >= total:
            stream.write(f"round {done // self.splits}/{total // self.splits} done\n")
        stream.flush()


def _measure(
    args: argparse.Namespace,
    plans: dict[str, Plan],
    stages: int,
    dtype: str | None,
    in_place: bool = False,
) -> dict[str, Measured]:
    build: Callable[[], Any] = functools.partial(
        load_units, args.model, dtype, args.granularity, tuple(args.leaf_modules)
    )
    progress = _Progress(len(plans))
    if args.ranks:
        from autopipe.distributed import time_splits_on_ranks

        try:
            return time_splits_on_ranks(
                build,
                plans,
                ranks=args.ranks,
                steps=args.steps,
                warmup=args.warmup,
                lr=LR,
                cuda=(args.device or default_device()).startswith("cuda"),
                progress=progress,
                in_place=in_place,
            )
        except RuntimeError as exc:  # a rank's failure, already one line
            raise ValueError(str(exc)) from None
    from autopipe.gpipe import time_splits

    layers, sample = build()
    return time_splits(
        layers,
        sample,
        plans,
        steps=args.steps,
        warmup=args.warmup,
        devices=gpipe_devices(args, stages),
        lr=LR,
        progress=progress,
        in_place=in_place,
    )


def bench_command(args: argparse.Namespace) -> int:
    """``autopipe bench``: plan every split, train each for a few steps, print the table."""
    from autopipe.output import (
        bench_record,
        check_picture_path,
        render_bench,
        summarize,
        unit_costs,
    )

    per_rank = stages_per_rank(args)  # combinations no runner runs fail here, first
    if args.ranks and args.stages and args.stages != args.ranks:
        if per_rank == 1:
            raise ValueError(
                f"--ranks {args.ranks} runs one stage per rank but --stages is "
                f"{args.stages}; give the same count, or leave out --stages"
            )
        raise ValueError(
            f"--ranks {args.ranks} runs {per_rank} stages per rank but --stages is "
            f"{args.stages}; --stages counts the ranks here: give {args.ranks}, or leave "
            "it out"
        )
    if args.ranks and args.chunks:  # before profiling, when the count is given
        check_chunks(args.schedule, args.ranks, per_rank, args.chunks)
    # K counts the devices (the ranks); the plans split the model into K·v stages.
    devices_k: int = args.stages or args.ranks or default_stages()
    stages = devices_k * per_rank
    names = strategy_names(args.strategies)
    if not names and args.balance is None:
        raise ValueError("--strategies names none; give at least one strategy or --balance")
    if args.picture:
        check_picture_path(args.picture, "benchmark picture")
    memory = cost_options(
        argparse.Namespace(
            memory=args.memory, bandwidth=None, allreduce_bandwidth=None, optimizer="sgd"
        )
    ).memory
    if isinstance(memory, list) and len(memory) != devices_k:
        where = f"{devices_k} stages" if per_rank == 1 else f"{devices_k} ranks"
        raise ValueError(
            f"--memory lists {len(memory)} sizes but there are {where}; give one size for "
            f"all or one per {'stage' if per_rank == 1 else 'rank'}"
        )
    if isinstance(memory, list) and per_rank > 1:  # each of a rank's stages gets its size
        from autopipe.planning import stage_placement

        memory = [memory[r] for r in stage_placement(stages, devices_k, args.schedule)]

    def check_units(units: int) -> None:
        if stages > units:
            raise PlanningError(_too_few_units(units, stages, per_rank, args.ranks))

    build: Callable[[], Any] = functools.partial(
        load_units, args.model, args.dtype, args.granularity, tuple(args.leaf_modules)
    )
    # Profiled at the micro-batch count of K devices, as the planner counts by default.
    inputs, profiled = profile_as_run(args, devices_k, check_units, build)
    profile = inputs.profile
    count = len(profile.layers)
    if stages > count:  # a loaded profile: checked here rather than by the planner
        raise PlanningError(_too_few_units(count, stages, per_rank, args.ranks))
    balance = given_balance(args.balance, stages, count, per_rank)
    chosen = PipelineSettings(
        chunks=inputs.chunks or args.chunks,
        memory=memory,
        checkpoint=args.checkpoint,
        schedule=args.schedule,
        optimizer="sgd",
        virtual_stages=per_rank,
        # In one process, stages on one device take turns on it.
        colocated=not args.ranks,
    ).resolved(devices_k, profile.batch_size)
    chunks = chosen.chunks
    if args.ranks and chunks is not None:  # a count from the profile or the default
        check_chunks(args.schedule, args.ranks, per_rank, chunks)
    planned = (
        "chunks",
        "memory",
        "checkpoint",
        "schedule",
        "optimizer",
        "virtual_stages",
        "colocated",
    )
    options = {name: getattr(chosen, name) for name in planned}
    # On ranks the planner counts the K·v stages, stage s on its rank by the schedule.
    devices: int | list[str] = stages if args.ranks else gpipe_devices(args, stages)
    calibrated = calibrate_runner(args, profile, per_rank)
    plans = _plans(profile, devices, names, balance, options, args.strategies is not None)
    first_of, distinct = _distinct(plans)
    dtype = args.dtype or (profile.dtype if profile.dtype not in (None, "float32") else None)
    runner = (
        f"{args.ranks} local ranks (DistributedPipeline)"
        if args.ranks
        else f"GPipe in one process on {', '.join(dict.fromkeys(gpipe_devices(args, stages)))}"
    )
    in_place = not args.no_calibrate and args.warmup >= 2
    with model_output_to_stderr():  # the model's steps may print; the table is stdout's
        _announce(len(distinct), args, runner)
        measured = _measure(args, distinct, stages, dtype, in_place)
        fitted_line = (
            ""
            if in_place or args.no_calibrate
            else "predicted from the profile: --warmup 2 or more times the splits in place"
        )
        if in_place:
            fitted, fitted_line = fit_in_place(profile, distinct, measured, devices, options)
            again = replan(fitted, plans, devices, options)
            first_again, distinct_again = _distinct(again)
            if set(map(_split_key, distinct_again.values())) - set(
                map(_split_key, distinct.values())
            ):
                # The figures moved optimal's split to one not run yet: run every split
                # again with it, and predict them all from that run's own warm-up steps.
                print("the in-place figures chose another split: running again", file=sys.stderr)
                _announce(len(distinct_again), args, runner)
                measured = _measure(args, distinct_again, stages, dtype, in_place)
                fitted, fitted_line = fit_in_place(
                    profile, distinct_again, measured, devices, options, _SECOND_RUN
                )
                again = replan(fitted, again, devices, options, optimal=False)
                first_again, distinct_again = _distinct(again)
            profile, plans, first_of, distinct = fitted, again, first_again, distinct_again
    costs = unit_costs(profile, stages, **options)
    summaries = [
        summarize(label, plans[label], measured[first_of[label]], costs) for label in plans
    ]
    same: dict[str, list[str]] = {}
    for label, first in first_of.items():
        if first != label:
            same.setdefault(first, []).append(label)
    header = (
        f"{_layout(stages, devices_k, per_rank, args.schedule)}, {chunks} micro-batches, "
        f"{_schedule_name(args.schedule, per_rank)}, checkpoint {chosen.checkpoint}, on "
        f"{runner}; {_count(args.steps, 'timed step')} per split after {args.warmup} "
        f"warm-up, loss: {LOSS}, SGD"
    )
    drawn = []
    if args.picture:
        from autopipe.output import draw_bench

        draw_bench(summaries, args.picture)
        drawn.append(f"picture written to {args.picture}")
    if args.json:
        settings = {
            "model": args.model,
            "stages": stages,
            "stages_per_rank": per_rank,
            "chunks": chunks,
            "schedule": args.schedule,
            "checkpoint": chosen.checkpoint,
            "runner": "distributed" if args.ranks else "gpipe",
            "ranks": args.ranks,
            "steps": args.steps,
            "warmup": args.warmup,
            "loss": LOSS,
            "optimizer": "sgd",
            "lr": LR,
            "memory": memory,
            "profiled": profiled,
            "calibrated": calibrated,
            "in_place": fitted_line,
            "shared": next(iter(plans.values())).shared,
        }
        record = bench_record(summaries, settings)
        # Each plan without its copy of the profile, which `autopipe profile` saves.
        # What the predictions were fitted on: each split's warm-up steps timed in place.
        record["in_place"] = {
            label: found.in_place for label, found in measured.items() if found.in_place
        }
        record["plans"] = {
            label: {key: value for key, value in plan.to_dict().items() if key != "profile"}
            for label, plan in plans.items()
        }
        _write_json(args.json, record)
        drawn.append(f"results written to {args.json}")
    notes = [profiled, calibrated, fitted_line, *_notes(plans), _strategies_note(plans, per_rank)]
    header += "".join(f"\n{line}" for line in notes if line)
    sys.stdout.write(render_bench(summaries, header))
    for first, labels in same.items():
        print(f"{', '.join(labels)}: the same split as {first}, measured once")
    for line in drawn:
        print(line, file=sys.stderr)
    return 0


def _split_key(found: Plan) -> tuple[Any, ...]:
    units = tuple(tuple(stage.recompute_units) for stage in found.stages)
    return (tuple(found.balance), tuple(found.stage_checkpoints), units)


def _distinct(plans: dict[str, Plan]) -> tuple[dict[str, str], dict[str, Plan]]:
    """Each label's first label of the same split, and those first labels' plans.

    Strategies that give the same split run the same steps: each split is measured once
    (timed apart, their noise alone would tell them apart).
    """
    first_of: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for label, found in plans.items():
        first_of[label] = seen.setdefault(_split_key(found), label)
    return first_of, {label: found for label, found in plans.items() if first_of[label] == label}


def _announce(splits: int, args: argparse.Namespace, runner: str) -> None:
    print(
        f"running {_count(splits, 'split')}, {_count(args.warmup, 'warm-up step')} and "
        f"{_count(args.steps, 'timed step')} each, on {runner}",
        file=sys.stderr,
    )


def _notes(plans: dict[str, Plan]) -> list[str]:
    """What the predictions assumed that a reader would not guess: stages taking turns."""
    from autopipe.output import shared_line

    found = next(iter(plans.values()))
    return [f"predicted: {shared_line(found, group)}" for group in found.shared]


def _too_few_units(units: int, stages: int, per_rank: int, ranks: int | None) -> str:
    """Why ``units`` cannot fill ``stages`` non-empty stages, and what fits."""
    if per_rank == 1:
        return (
            f"cannot split {units} units into {stages} non-empty stages; "
            f"use --stages {units} or fewer"
        )
    option = "--ranks" if ranks else "--stages"
    return (
        f"cannot split {units} units into {stages} non-empty stages ({per_rank} per rank); "
        f"use {option} {units // per_rank} or fewer"
    )


def _layout(stages: int, ranks: int, per_rank: int, schedule: str) -> str:
    """Where the stages run: ``4 stages``, or those of several per rank and how placed."""
    if per_rank == 1:
        return f"{stages} stages"
    if schedule in V_SCHEDULES:
        return f"{stages} stages, 2 per rank in a V (rank r holds stages r and {stages - 1}-r)"
    held = ", ".join(f"r+{ranks * k}" if k else "r" for k in range(per_rank))
    return f"{stages} stages, {per_rank} per rank interleaved (rank r holds stages {held})"


def _schedule_name(schedule: str, per_rank: int) -> str:
    """The schedule as the header names it: torch's own for several stages per rank."""
    if schedule in V_SCHEDULES:
        torch_name = "ScheduleZBVZeroBubble" if schedule == "zbv" else "ScheduleDualPipeV"
        return f"{schedule} schedule (torch's {torch_name})"
    if per_rank > 1:
        torch_name = "ScheduleInterleaved1F1B" if schedule == "1f1b" else "ScheduleLoopedBFS"
        return f"interleaved {schedule} schedule (torch's {torch_name})"
    return f"{schedule} schedule"


# What each strategy's split of K·v stages is, where the strategy's own library runs
# no such schedule: its rule applied to the K·v stages, which is not a split it runs.
_PEERS = {
    "uniform": "DeepSpeed's partition_uniform",
    "parameters": "DeepSpeed's partition by parameters",
    "blockpartition": "torchgpipe's balance_by_time",
}


def _strategies_note(plans: dict[str, Plan], per_rank: int) -> str:
    """How the strategies split several stages per rank, honestly: which splits are a
    library's own and which its rule applied to stages it never runs so."""
    if per_rank == 1:
        return ""
    found = next(iter(plans.values()))
    count = found.num_stages
    schedule = "V schedules" if found.schedule in V_SCHEDULES else "interleaved schedules"
    parts = []
    peers = [f"{label} ({_PEERS[label]})" for label in plans if label in _PEERS]
    if peers:
        parts.append(
            f"{', '.join(peers)}: the rule applied to the {count} stages, as the library "
            f"would (it runs no {schedule}: a split it never runs)"
        )
    if "torchtitan" in plans:
        parts.append(f"torchtitan: its own split of the {count} stages of its {schedule}")
    if "optimal" in plans:
        parts.append(f"optimal: the best {count}-stage split by the replayed {schedule[:-1]}")
    return f"splits of {count} stages: " + "; ".join(parts) if parts else ""


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _write_json(path: str, record: dict[str, Any]) -> None:
    target = Path(path)
    temporary = target.with_name(target.name + ".tmp")
    try:
        temporary.write_text(json.dumps(record, indent=2) + "\n")
        temporary.replace(target)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise ValueError(f"cannot write the results to {path}: {exc.strerror or exc}") from None
