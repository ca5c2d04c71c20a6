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
    given_balance,
    gpipe_devices,
    strategy_names,
)
from autopipe.cli.model_output import model_output_to_stderr
from autopipe.cli.options import cost_options, default_device, default_stages
from autopipe.planning import PipelineSettings

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

    if args.ranks and args.stages and args.stages != args.ranks:
        raise ValueError(
            f"--ranks {args.ranks} runs one stage per rank but --stages is {args.stages}; "
            "give the same count, or leave out --stages"
        )
    if args.schedule != "gpipe" and not args.ranks:
        raise ValueError(
            f"--schedule {args.schedule} runs on the distributed runner: add --ranks K (the "
            "single-process GPipe runs the gpipe schedule only)"
        )
    stages: int = args.stages or args.ranks or default_stages()
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
    if isinstance(memory, list) and len(memory) != stages:
        raise ValueError(
            f"--memory lists {len(memory)} sizes but there are {stages} stages; give one "
            "size for all or one per stage"
        )

    def check_units(units: int) -> None:
        if stages > units:
            raise PlanningError(
                f"cannot split {units} units into {stages} non-empty stages; "
                f"use --stages {units} or fewer"
            )

    build: Callable[[], Any] = functools.partial(
        load_units, args.model, args.dtype, args.granularity, tuple(args.leaf_modules)
    )
    inputs, profiled = profile_as_run(args, stages, check_units, build)
    profile = inputs.profile
    count = len(profile.layers)
    if stages > count:  # a loaded profile: checked here rather than by the planner
        raise PlanningError(
            f"cannot split {count} units into {stages} non-empty stages; "
            f"use --stages {count} or fewer"
        )
    balance = given_balance(args.balance, stages, count)
    chosen = PipelineSettings(
        chunks=inputs.chunks or args.chunks,
        memory=memory,
        checkpoint=args.checkpoint,
        schedule=args.schedule,
        optimizer="sgd",
        # In one process, stages on one device take turns on it.
        colocated=not args.ranks,
    ).resolved(stages, profile.batch_size)
    chunks = chosen.chunks
    planned = ("chunks", "memory", "checkpoint", "schedule", "optimizer", "colocated")
    options = {name: getattr(chosen, name) for name in planned}
    devices: int | list[str] = args.ranks or gpipe_devices(args, stages)
    calibrated = calibrate_runner(args, profile)
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
        f"{stages} stages, {chunks} micro-batches, {args.schedule} schedule, checkpoint "
        f"{args.checkpoint}, on {runner}; {_count(args.steps, 'timed step')} per split after "
        f"{args.warmup} warm-up, loss: {LOSS}, SGD"
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
            "chunks": chunks,
            "schedule": args.schedule,
            "checkpoint": args.checkpoint,
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
    notes = [profiled, calibrated, fitted_line, *_notes(plans)]
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
