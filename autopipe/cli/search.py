"""The ``autopipe plan --search`` and ``autopipe calibrate`` commands."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autopipe.planning.names import SCHEDULES
from autopipe.planning.quantities import format_bytes, format_time

__all__ = ["add_calibrate_parser", "add_search_options", "calibrate_command", "search_command"]


def _positive(text: str) -> int:
    from autopipe.cli.app import _positive as positive

    return positive(text)


def add_search_options(parser: argparse.ArgumentParser) -> None:
    """The ``--search`` options of ``autopipe plan``."""
    search = parser.add_argument_group(
        "search", "rank pipeline depth x data-parallel width x micro-batches x checkpointing"
    )
    search.add_argument(
        "--search",
        action="store_true",
        help="search the configurations of --devices devices and print the best ones, "
        "then the best plan (--json writes it)",
    )
    search.add_argument(
        "--devices", type=_positive, metavar="N", help="devices to use (default: as --stages)"
    )
    search.add_argument(
        "--batch",
        type=_positive,
        metavar="B",
        help="samples per step, across replicas with --search (default: the sample's)",
    )
    search.add_argument(
        "--top", type=_positive, default=10, metavar="T", help="rows to print (default: 10)"
    )
    search.add_argument(
        "--allreduce-bandwidth",
        metavar="BYTES_PER_S",
        help="bandwidth of the gradient all-reduce between replicas (default: --bandwidth)",
    )
    search.add_argument(
        "--even",
        action="store_true",
        help="only replica and micro-batch counts that split the batch into equal parts "
        "(what the distributed runner needs for models with BatchNorm)",
    )


def add_calibrate_parser(commands: Any) -> None:
    """The ``autopipe calibrate`` sub-command."""
    parser = commands.add_parser(
        "calibrate",
        help="measure the executor overhead and link bandwidth and store them in a profile",
        description="Measure GPipe's fixed cost per stage and micro-batch and the copy "
        "bandwidth between the devices, and store both in PROFILE.json; `autopipe plan "
        "--profile` then uses them.",
    )
    parser.add_argument("profile", metavar="PROFILE.json", help="a saved profile")
    parser.add_argument(
        "-o", "--output", metavar="FILE", help="where to write it (default: in place)"
    )
    parser.add_argument(
        "--devices",
        metavar="DEV[,DEV...]",
        help="the stage devices, e.g. cuda:0,cuda:1 (default: the profile's device twice, "
        "or all GPUs)",
    )
    parser.add_argument(
        "--repeats", type=_positive, default=10, metavar="N", help="timed runs (default: 10)"
    )
    parser.add_argument(
        "--model",
        metavar="MODEL.py",
        help="the profiled model file: also time its whole training step and store how much "
        "longer its layers run there than alone (compute_scale)",
    )
    from autopipe.cli.app import add_tracing_options

    add_tracing_options(parser)
    parser.set_defaults(func=calibrate_command)


def _check_search_options(args: argparse.Namespace) -> None:
    if args.stages:
        raise ValueError("--search chooses the stages itself: give the devices with --devices")
    if args.strategy != "optimal":
        raise ValueError("--search plans with the optimal strategy: leave out --strategy")
    if args.compare:
        raise ValueError("--compare is not available with --search; use --timeline")


def search_command(args: argparse.Namespace) -> int:
    """Ranks the configurations of ``--devices`` devices, prints them and the best plan."""
    from autopipe.cli import app as cli
    from autopipe.planning.config_search import search
    from autopipe.planning.names import SEARCH_CHECKPOINTS
    from autopipe.planning.report import render_plan, render_search

    _check_search_options(args)
    memory = cli._memory(args.memory)
    if isinstance(memory, list):
        raise ValueError("--search needs one --memory size, the same for every device")
    bandwidth = cli._bandwidth(args.bandwidth)
    allreduce = cli._bandwidth(args.allreduce_bandwidth)
    optimizer = cli._optimizer(args.optimizer)
    devices: int = args.devices or cli.default_stages()
    if args.json:
        cli._check_writable(args.json, "plan")
    if args.timeline:
        cli._check_picture(args.timeline, "timeline")
    if args.profile:
        profile = cli._load_profile(args)
        if args.model:  # the plan is for its sample's batch, unless --batch says otherwise
            _, sample = cli._load_matching(args, profile, args.profile, args.model)
            args.batch = args.batch or cli._batch_size(sample)
    elif args.model:
        model, sample = cli._load(args, args.dtype)
        chunks = args.chunks or cli.default_chunks(devices, cli._batch_size(sample))
        profile = cli._measure(model, sample, args, chunks)
    else:
        raise ValueError("give a model file (autopipe plan MODEL.py) or --profile FILE")

    plans = search(
        profile,
        devices,
        memory=memory,
        batch=args.batch,
        schedules=(args.schedule,) if args.schedule else SCHEDULES,
        checkpoints=(args.checkpoint,) if args.checkpoint else SEARCH_CHECKPOINTS,
        optimizer=optimizer,
        bandwidth=bandwidth,
        allreduce_bandwidth=allreduce,
        top=args.top,
        even=args.even,
        virtual_stages=tuple(range(1, args.virtual_stages + 1)),
    )
    best = plans[0]
    if args.timeline:
        from autopipe.planning.timeline import draw_timeline

        draw_timeline(best, args.timeline)
    if args.json:
        cli._save(best, args.json, "plan")
    sys.stdout.write(render_search(plans) + "\n\nthe best plan:\n" + render_plan(best))
    if args.json:
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.timeline:
        print(f"timeline written to {args.timeline}", file=sys.stderr)
    return 0


def calibrate_command(args: argparse.Namespace) -> int:
    """Measures overhead and bandwidth and stores them in the profile."""
    from autopipe.cli import app as cli
    from profiler.profile import Profile

    output = args.output or args.profile
    cli._check_writable(output, "profile")
    profile = Profile.load(args.profile)
    devices = None
    if args.devices is not None:
        from autopipe.cli.checks import check_device_list

        devices = check_device_list(args.devices)
    from autopipe.gpipe.calibration import calibrate

    model = sample = None
    if args.model:  # timed as it was profiled: cast to the profile's dtype
        model, sample = cli._load_matching(args, profile, args.profile, args.model)
    if sys.stderr.isatty():  # progress for a person; errors stay one line in logs
        what = "executor overhead, link" + (f", whole steps of {args.model}" if model else "")
        print(f"calibrating: {what} ({args.repeats} repeats each)...", file=sys.stderr)
    try:
        values = calibrate(profile, devices, repeats=args.repeats, model=model, sample=sample)
    except (RuntimeError, AssertionError) as exc:  # e.g. a device torch cannot use
        message = " ".join(str(exc).split())
        raise ValueError(f"calibration failed: {type(exc).__name__}: {message}") from None
    cli._save(profile, output, "profile")
    where = " -> ".join(dict.fromkeys(values["devices"]))
    scale = (
        f"; in a whole step layers run {values['fixed_scale']:.2f}x their profiled time per "
        f"micro-batch and {values['compute_scale']:.2f}x per sample"
        if "compute_scale" in values and "fixed_scale" in values
        else ""
    )
    print(
        f"executor overhead {format_time(values['overhead_s'])} per stage and micro-batch; "
        f"{where} copies at {format_bytes(values['bandwidth'])}/s{scale}; wrote {output}"
    )
    return 0
