"""The ``autopipe calibrate`` command: measure the executor and the links, store them."""

from __future__ import annotations

import argparse
import sys

from autopipe.cli.inputs import load_matching
from autopipe.cli.model_output import model_output_to_stderr
from autopipe.cli.options import check_writable, save
from autopipe.planning import format_bytes, format_time

__all__: list[str] = []  # internal to the command line


def calibrate_command(args: argparse.Namespace) -> int:
    """Measures overhead and bandwidth and stores them in the profile."""
    from profiler import Profile

    output = args.output or args.profile
    check_writable(output, "profile")
    profile = Profile.load(args.profile)
    devices = None
    if args.devices is not None:
        from autopipe.cli.checks import check_device_list

        devices = check_device_list(args.devices)
    from autopipe.gpipe import calibrate_executor

    model = sample = None
    if args.model:  # timed as it was profiled: cast to the profile's dtype
        model, sample = load_matching(args, profile, args.profile, args.model)
    if sys.stderr.isatty():  # progress for a person; errors stay one line in logs
        what = "executor overhead, link" + (f", whole steps of {args.model}" if model else "")
        print(f"calibrating: {what} ({args.repeats} repeats each)...", file=sys.stderr)
    try:
        with model_output_to_stderr():  # the model's whole steps may print
            values = calibrate_executor(
                profile, devices, repeats=args.repeats, model=model, sample=sample
            )
    except (RuntimeError, AssertionError) as exc:  # e.g. a device torch cannot use
        message = " ".join(str(exc).split())
        raise ValueError(f"calibration failed: {type(exc).__name__}: {message}") from None
    save(profile, output, "profile")
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
