"""The ``autopipe plan`` command: profile or load, plan, print, draw."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from autopipe.cli.exports import parse_exports, render_exports, to_stdout, write_exports
from autopipe.cli.inputs import read_profile
from autopipe.cli.options import (
    check_plan_outputs,
    check_precision,
    cost_options,
    default_stages,
    save,
)
from autopipe.cli.target import check_target_options, estimated, target_devices
from autopipe.errors import PlanningError
from autopipe.planning.names import STRATEGIES
from autopipe.planning.planner import default_chunks

if TYPE_CHECKING:
    from autopipe.planning.devices import DeviceSpec
    from autopipe.planning.plans import Plan
    from profiler.profile import Profile

__all__: list[str] = []  # internal to the command line


def _devices(profile: Profile, stages: int, virtual: int = 1) -> int | list[str]:
    """Stage devices named ``cuda:0``, ``cuda:1``, ... for a CUDA profile, else a count.

    With ``virtual`` stages per device there are ``stages·virtual`` stages, stage s on
    device ``s % stages``.
    """
    if profile.device.startswith("cuda"):
        return [f"cuda:{k % stages}" for k in range(stages * virtual)]
    return stages * virtual


def plan_command(args: argparse.Namespace) -> int:
    """``autopipe plan``: profile (or load) and print the best split, with pictures."""
    from autopipe.planning.planner import plan
    from autopipe.planning.report import render_plan

    check_precision(args)
    target = check_target_options(args)
    if args.one_device and (args.virtual_stages > 1 or args.target):
        raise ValueError(
            "--one-device plans one pipeline whose stages take turns on one device; leave "
            "out --virtual-stages and --target"
        )
    if args.devices or args.allreduce_bandwidth or args.even:
        raise ValueError(
            "--devices, --allreduce-bandwidth and --even go with --search; use --stages"
        )
    costs = cost_options(args)
    memory = costs.memory
    stages: int = args.stages or default_stages()
    if isinstance(memory, list) and len(memory) != stages:
        raise ValueError(
            f"--memory lists {len(memory)} sizes but there are {stages} stages; give one "
            "size for all or one per stage"
        )
    virtual: int = args.virtual_stages
    if isinstance(memory, list) and virtual > 1:  # one size per device: each of its stages
        memory = [memory[k % stages] for k in range(stages * virtual)]
    check_plan_outputs(args)
    exports = parse_exports(args.export)

    def check_layers(layers: int) -> None:
        if stages * virtual > layers:
            raise PlanningError(
                f"cannot split {layers} layers into {stages * virtual} non-empty stages; "
                f"use --stages {layers // virtual} or fewer"
            )

    inputs = read_profile(args, stages, measure_batch=args.batch, check_model=check_layers)
    profile = inputs.profile
    devices: int | list[str] | list[DeviceSpec]
    if target is not None:
        profile = estimated(profile, args, target)
        devices = target_devices(args, target, stages, virtual, costs.memory)
        memory = None  # each device's capacity is in its spec
    else:
        devices = _devices(profile, stages, virtual)
    chunks = (
        inputs.chunks or args.chunks or default_chunks(stages, inputs.batch or profile.batch_size)
    )

    options: dict[str, Any] = {
        "batch": inputs.batch,
        "chunks": chunks,
        "memory": memory,
        # Interleaved stages run on torch's schedules, which keep every activation.
        "checkpoint": args.checkpoint
        or ("never" if virtual > 1 or args.schedule == "zb" else "except_last"),
        "schedule": args.schedule or "gpipe",
        "optimizer": costs.optimizer,
        "bandwidth": costs.bandwidth,
        "virtual_stages": virtual,
        "colocated": args.one_device,
    }
    if args.one_device:
        devices = [profile.device] * stages
    result = plan(profile, devices, strategy=args.strategy, **options)
    other = "optimal" if args.strategy == "uniform" else "uniform"
    baseline: Plan | str
    try:
        baseline = plan(profile, devices, strategy=other, **options)
    except PlanningError as exc:
        baseline = str(exc)

    # Exports and pictures first: a failure leaves no plan file and no report behind.
    exported = render_exports(result, exports)
    drawn = []
    if args.timeline:
        from autopipe.planning.timeline import draw_timeline

        draw_timeline(result, args.timeline)
        drawn.append(f"timeline written to {args.timeline}")
    if args.compare:
        from autopipe.planning.timeline import draw_stage_bars

        known = {result.strategy: result}
        if not isinstance(baseline, str):
            known[baseline.strategy] = baseline
        draw_stage_bars(_strategy_plans(profile, devices, options, known), args.compare)
        drawn.append(f"comparison written to {args.compare}")
    if args.trace:
        from autopipe.planning.trace_events import write_trace

        write_trace(result, args.trace)
        drawn.append(f"trace written to {args.trace}")
    if args.json:
        save(result, args.json, "plan")
    # An export on stdout is meant to be redirected: the report goes to stderr then.
    report = sys.stderr if to_stdout(exports) else sys.stdout
    report.write(render_plan(result, baseline, other))
    write_exports(exports, exported)
    if args.json:
        print(f"plan written to {args.json}", file=sys.stderr)
    for line in drawn:
        print(line, file=sys.stderr)
    return 0


def _strategy_plans(
    profile: Profile,
    devices: int | list[str] | list[DeviceSpec],
    options: dict[str, Any],
    known: dict[str, Plan],
) -> dict[str, Plan]:
    """Plans of every strategy that fits, by name; ``known`` ones are not planned again."""
    from autopipe.planning.planner import plan

    plans: dict[str, Plan] = {}
    for name in STRATEGIES:
        if name in known:
            plans[name] = known[name]
            continue
        try:
            plans[name] = plan(profile, devices, strategy=name, **options)
        except PlanningError:  # a baseline that does not fit is left out of the picture
            continue
    return plans
