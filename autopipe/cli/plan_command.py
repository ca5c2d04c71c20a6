"""The ``autopipe plan`` command: profile or load, plan, print, draw."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from autopipe import PlanningError
from autopipe.cli.export_option import parse_exports, render_exports, to_stdout, write_exports
from autopipe.cli.inputs import read_profile
from autopipe.cli.options import (
    check_plan_outputs,
    check_precision,
    cost_options,
    default_stages,
    save,
)
from autopipe.cli.target import check_target_options, estimated, target_devices
from autopipe.planning import PipelineSettings

if TYPE_CHECKING:
    from autopipe.planning import DeviceSpec

__all__: list[str] = []  # internal to the command line


def plan_command(args: argparse.Namespace) -> int:
    """``autopipe plan``: profile (or load) and print the best split, with pictures."""
    from autopipe.output import render_plan
    from autopipe.planning import V_SCHEDULES, compare_plans, profile_devices, stage_placement

    check_precision(args)
    target = check_target_options(args)
    if args.one_device and (args.virtual_stages > 1 or args.target):
        raise ValueError(
            "--one-device plans one pipeline whose stages take turns on one device; leave "
            "out --virtual-stages and --target"
        )
    if args.recompute_norms == "auto":
        raise ValueError(
            "--recompute-norms auto weighs the norms kept and re-computed in --search; "
            "without --search give --recompute-norms alone"
        )
    if args.devices or args.allreduce_bandwidth or args.even:
        raise ValueError(
            "--devices, --allreduce-bandwidth and --even go with --search; use --stages"
        )
    meshed = [
        option
        for option, given in (
            ("--tensor-parallel", args.tensor_parallel is not None),
            ("--context-parallel", args.context_parallel is not None),
            ("--sequence-parallel", args.sequence_parallel),
            ("--zero", args.zero is not None),
            ("--expert-parallel", args.expert_parallel is not None),
            ("--global-batch", args.global_batch is not None),
            ("--micro-batch", args.micro_batch is not None),
        )
        if given
    ]
    if meshed:  # the mesh around the pipeline is what --search weighs
        raise ValueError(
            f"{', '.join(meshed)} plan the mesh around the pipeline: add --search --devices N "
            "(list one degree to fix it, e.g. --tensor-parallel 4)"
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
    if args.schedule in V_SCHEDULES:  # 2 stages per device in a V
        if virtual not in (1, 2):
            raise ValueError(
                f"--schedule {args.schedule} runs 2 stages per device; leave out "
                f"--virtual-stages {virtual} or give 2"
            )
        virtual = 2
    if isinstance(memory, list) and virtual > 1:  # one size per device: each of its stages
        where = stage_placement(stages * virtual, stages, args.schedule or "1f1b")
        memory = [memory[r] for r in where]
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
        devices = profile_devices(profile, stages, virtual, colocated=args.one_device)
    settings = PipelineSettings(
        batch=inputs.batch,
        chunks=inputs.chunks or args.chunks,
        memory=memory,
        checkpoint=args.checkpoint,
        schedule=args.schedule,
        strategy=args.strategy,
        optimizer=costs.optimizer,
        bandwidth=costs.bandwidth,
        virtual_stages=virtual,
        colocated=args.one_device,
        recompute_norms=args.recompute_norms == "on",
        recompute_up_proj=args.recompute_up_proj,
    ).resolved(stages, inputs.batch or profile.batch_size)
    compared = compare_plans(profile, devices, settings)
    result, baseline, other = compared.plan, compared.baseline, compared.baseline_strategy

    # Exports and pictures first: a failure leaves no plan file and no report behind.
    exported = render_exports(result, exports)
    drawn = []
    if args.timeline:
        from autopipe.output import draw_timeline

        draw_timeline(result, args.timeline)
        drawn.append(f"timeline written to {args.timeline}")
    if args.compare:
        from autopipe.output import draw_stage_bars

        draw_stage_bars(compared.every_strategy(), args.compare)
        drawn.append(f"comparison written to {args.compare}")
    if args.trace:
        from autopipe.output import write_trace

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
