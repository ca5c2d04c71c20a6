"""``autopipe bench``'s profile and calibration, made in the conditions the splits run in.

On local ranks each rank computes on its own share of the CPUs with as many threads
(:func:`autopipe.distributed.cpu_binding.bind_cpus`): the model is profiled bound to
rank 0's share, not with every core, and the runner's own costs (its seconds per stage
and micro-batch, a message between ranks) come from the calibration cache of this
machine and runtime, measured on the ranks the first time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from autopipe.cli.inputs import Inputs, read_profile
from autopipe.cli.options import default_device
from autopipe.planning.quantities import format_bytes, format_time

if TYPE_CHECKING:
    from torch import nn

    from profiler.profile import Profile

__all__: list[str] = []  # internal to the command line


def _on_ranks_cpu(args: argparse.Namespace) -> bool:
    return bool(args.ranks) and not (args.device or default_device()).startswith("cuda")


def profile_as_run(
    args: argparse.Namespace,
    stages: int,
    check_model: Callable[[nn.Sequential], None],
) -> tuple[Inputs, str]:
    """The profile to plan from, and a line saying how it was made.

    On CPU ranks the layers are timed bound to rank 0's CPUs with its threads, as a rank
    runs them (ranks' shares differ by one CPU at most).
    """
    import torch

    from autopipe.cli.bench_options import profile_args

    if args.profile:
        return read_profile(profile_args(args), stages, check_model=check_model), (
            f"profile: {args.profile}"
        )
    if _on_ranks_cpu(args):
        from autopipe.distributed.cpu_binding import bound_as

        with bound_as(0, args.ranks) as share:
            inputs = read_profile(profile_args(args), stages, check_model=check_model)
            threads = torch.get_num_threads()
        cpus = ",".join(str(c) for c in share)
        how = f"bound to CPU {cpus} with {_count(threads, 'thread')}, as rank 0 runs"
    else:
        inputs = read_profile(profile_args(args), stages, check_model=check_model)
        how = f"in this process with {_count(torch.get_num_threads(), 'thread')}"
    spread = inputs.profile.meta.get("spread")
    noise = f", layer times' median spread {spread:.0%}" if isinstance(spread, float) else ""
    return inputs, (f"profiled {how} ({args.profile_repeats} timed runs per layer, medians{noise})")


def calibrate_runner(args: argparse.Namespace, profile: Profile) -> str:
    """Applies the runner's calibration for ``--ranks`` to ``profile`` (cached, else
    measured on the ranks and cached); the line saying what it applied, or why none."""
    if not args.ranks:
        return ""
    if args.no_calibrate:
        return "not calibrated (--no-calibrate): the runner's own costs count as free"
    from autopipe.distributed.bench import calibrate_local_ranks
    from autopipe.distributed.calibration_cache import (
        apply_runner_calibration,
        cache_file,
        cached_runner_calibration,
        runtime_key,
        save_runner_calibration,
    )
    from autopipe.distributed.cpu_binding import cpu_share

    cuda = not _on_ranks_cpu(args)
    if cuda:
        threads, bound, backend = 0, False, "nccl"
    else:
        import os

        threads = len(cpu_share(sorted(os.sched_getaffinity(0)), 0, args.ranks))
        bound, backend = True, "gloo"
    key = runtime_key(
        backend=backend, ranks=args.ranks, threads=threads, bound=bound, schedule=args.schedule
    )
    found = None if args.recalibrate else cached_runner_calibration(key)
    if found is None:
        try:
            measured = calibrate_local_ranks(args.ranks, schedule=args.schedule, cuda=cuda)
        except RuntimeError as exc:
            raise ValueError(f"calibrating the ranks failed: {exc}") from None
        found = save_runner_calibration(key, measured)
        when = f"measured now, kept in {cache_file()}"
    else:
        stamp = found.get("measured_at")
        day = time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "earlier"
        when = f"cached from {day} in {cache_file()}"
    apply_runner_calibration(profile, found)
    return (
        f"calibrated: the runner costs {format_time(found['overhead_s'])} per stage and "
        f"micro-batch, a message {format_time(found.get('latency_s', 0.0))} + "
        f"{format_bytes(found.get('bandwidth', 0.0))}/s ({when})"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"
