"""The ``autopipe plan --search`` command: rank the configurations of the devices."""

from __future__ import annotations

import argparse
import sys

from autopipe.cli.inputs import read_profile
from autopipe.cli.options import (
    check_plan_outputs,
    check_precision,
    cost_options,
    default_stages,
    save,
)
from autopipe.cli.target import check_target_options, estimated, search_links
from autopipe.planning import SCHEDULES, SEARCH_CHECKPOINTS, PipelineSettings

__all__: list[str] = []  # internal to the command line


def _check_search_options(args: argparse.Namespace) -> None:
    if args.stages:
        raise ValueError("--search chooses the stages itself: give the devices with --devices")
    if args.strategy != "optimal":
        raise ValueError("--search plans with the optimal strategy: leave out --strategy")
    if args.compare:
        raise ValueError("--compare is not available with --search; use --timeline")
    if args.one_device and (args.target or args.allreduce_bandwidth):
        raise ValueError(
            "--search --one-device ranks stages taking turns on this profile's one device, "
            "with one replica: leave out --target and --allreduce-bandwidth"
        )


def search_command(args: argparse.Namespace) -> int:
    """Ranks the configurations of ``--devices`` devices (with ``--one-device``: of up to
    that many stages taking turns on one device), prints them and the best plan."""
    from autopipe.output import render_plan, render_search
    from autopipe.planning import SearchOptions, search

    check_precision(args)
    target = check_target_options(args)
    _check_search_options(args)
    costs = cost_options(args, memory_per_stage=False)
    memory = costs.memory
    assert not isinstance(memory, list)  # cost_options refused a list
    devices: int = args.devices or default_stages()
    check_plan_outputs(args)  # --compare is refused above
    # --batch is the step's, across replicas: the layers are measured for the sample's.
    inputs = read_profile(args, devices)
    profile = inputs.profile
    bandwidth, allreduce = costs.bandwidth, costs.allreduce_bandwidth
    if target is not None:
        profile = estimated(profile, args, target)
        memory = memory or target.memory
        links = search_links(args, target, devices)
        bandwidth = bandwidth or links[0]
        allreduce = allreduce or links[1]

    settings = PipelineSettings(
        memory=memory,
        batch=inputs.batch,
        optimizer=costs.optimizer,
        bandwidth=bandwidth,
        allreduce_bandwidth=allreduce,
    )
    # One device runs its stages in one process, under GPipe's fill-drain.
    schedules = ("gpipe",) if args.one_device else SCHEDULES
    options = SearchOptions(
        schedules=(args.schedule,) if args.schedule else schedules,
        checkpoints=(args.checkpoint,) if args.checkpoint else SEARCH_CHECKPOINTS,
        top=args.top,
        even=args.even,
        virtual_stages=tuple(range(1, args.virtual_stages + 1)),
        shard_optimizer=args.shard_optimizer,
        one_device=args.one_device,
    )
    plans = search(profile, devices, settings, options)
    best = plans[0]
    if args.timeline:
        from autopipe.output import draw_timeline

        draw_timeline(best, args.timeline)
    if args.trace:
        from autopipe.output import write_trace

        write_trace(best, args.trace)
    if args.json:
        save(best, args.json, "plan")
    sys.stdout.write(render_search(plans) + "\n\nthe best plan:\n" + render_plan(best))
    if args.json:
        print(f"plan written to {args.json}", file=sys.stderr)
    if args.timeline:
        print(f"timeline written to {args.timeline}", file=sys.stderr)
    if args.trace:
        print(f"trace written to {args.trace}", file=sys.stderr)
    return 0
