"""The options of ``autopipe bench`` and the checks of their values."""

from __future__ import annotations

import argparse

from autopipe.cli.arguments import add_tracing_options, positive
from autopipe.cli.options import default_device
from autopipe.planning import CHECKPOINT_MODES, STRATEGIES, V_SCHEDULES
from profiler import DTYPES

__all__: list[str] = []  # internal to the command line

# The schedules the bench runs: the single-process GPipe's, and on --ranks torch's 1F1B
# and its V-shaped zero-bubble schedules (2 stages per rank, rank r holding r and 2K−1−r).
SCHEDULES = ("gpipe", "1f1b", *V_SCHEDULES)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``autopipe bench``."""
    parser.add_argument("model", metavar="MODEL.py", help="the model file")
    parser.add_argument(
        "--stages",
        type=positive,
        metavar="K",
        help="pipeline stages, one per device (default: --ranks, else as autopipe plan); "
        "with --virtual-stages V or a V schedule, the K ranks of K x V (or 2K) stages",
    )
    parser.add_argument(
        "--chunks", type=positive, metavar="M", help="micro-batches per step (default: as plan)"
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="gpipe",
        help="pipeline schedule (default: gpipe); all but gpipe need --ranks: 1f1b, and "
        "torch's V-shaped zero-bubble zbv and dualpipev, which run 2K stages on the K ranks "
        "(rank r holds stages r and 2K-1-r; every split is of the 2K stages, M >= 2K, "
        "checkpoint never)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=positive,
        metavar="V",
        help="with --ranks and gpipe or 1f1b: V interleaved stages per rank, K x V in all, "
        "stage s on rank s mod K (torch's ScheduleInterleaved1F1B for 1f1b, "
        "ScheduleLoopedBFS for gpipe; default: 1); not with zbv or dualpipev, which place "
        "their 2 stages per rank themselves",
    )
    parser.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_MODES,
        help="activation checkpointing (default: except_last; never with --virtual-stages "
        "above 1, zbv and dualpipev, whose schedules keep every activation; the V "
        "schedules take only never)",
    )
    parser.add_argument(
        "--strategies",
        default=None,
        metavar="NAME[,NAME...]",
        help=f"the strategies to compare (default: those of {','.join(STRATEGIES)} that "
        "apply; torchtitan to decoder-only models)",
    )
    parser.add_argument(
        "--balance",
        metavar="N[,N...]",
        help="also run this split of your own: units per stage, e.g. 3,5,4 (K x V or 2K "
        "counts, in stage order, with several stages per rank)",
    )
    parser.add_argument(
        "--ranks",
        type=positive,
        metavar="K",
        help="run on K local processes, one per stage (gloo on the CPU, nccl on GPUs) with "
        "the distributed runner, instead of the single-process GPipe; with "
        "--virtual-stages V or a V schedule each rank holds V (or 2) stages",
    )
    parser.add_argument(
        "--steps", type=positive, default=10, metavar="N", help="timed steps per split (10)"
    )
    parser.add_argument(
        "--warmup",
        type=non_negative,
        default=4,
        metavar="W",
        help="untimed steps per split before timing (default: 4); the later half (the "
        "first always left out) are timed in place and the predictions made from them "
        "(2 or more; see --no-calibrate)",
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE[,SIZE...]",
        help="memory per device (one size, or one per stage; with several stages per rank "
        "one per rank, its stages together): splits must fit it",
    )
    parser.add_argument(
        "--device",
        help="where to profile and run the stages (default: cuda:0 when CUDA is available, "
        "else cpu); on CUDA the single-process stages go on cuda:0, cuda:1, ...",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="cast the model to this dtype first")
    parser.add_argument(
        "--profile", metavar="FILE", help="plan from this saved profile instead of profiling"
    )
    parser.add_argument(
        "--profile-repeats",
        type=positive,
        default=9,
        metavar="N",
        help="timed runs per layer when profiling, their median kept (default: 9)",
    )
    parser.add_argument(
        "--profile-warmup",
        type=non_negative,
        default=2,
        metavar="N",
        help="untimed runs per layer when profiling (default: 2)",
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="predict from the profile alone: no in-step scales, no figures timed in the "
        "warm-up steps and, with --ranks, the runner's own costs left out (default: apply "
        "this machine's cached calibration for the runtime, measured on the ranks the "
        "first time)",
    )
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --ranks: measure the runner's calibration again and replace the cached one",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    parser.add_argument(
        "--picture",
        metavar="FILE",
        help="also draw each split's measured step, its spread, prediction and the ideal "
        "(.png or .svg; needs matplotlib)",
    )
    add_tracing_options(parser)


def non_negative(text: str) -> int:
    """An option value that must be an integer of at least 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def strategy_names(text: str | None) -> list[str]:
    """The strategies ``--strategies`` names, each once (``None``: all); an unknown one is a
    ``ValueError``."""
    if text is None:
        return list(STRATEGIES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    for name in names:
        if name not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {name!r} in --strategies: choose from {', '.join(STRATEGIES)}"
            )
    return list(dict.fromkeys(names))


def stages_per_rank(args: argparse.Namespace) -> int:
    """The stages each rank holds: 2 under a V schedule, ``--virtual-stages``, else 1.

    Raises:
        ValueError: a combination no runner runs: a schedule other than gpipe, or
            ``--virtual-stages``, without ``--ranks``; ``--virtual-stages`` with a V
            schedule; a V schedule with checkpointing.
    """
    schedule, virtual = args.schedule, args.virtual_stages
    placed = schedule in V_SCHEDULES
    if schedule != "gpipe" and not args.ranks:
        raise ValueError(
            f"--schedule {schedule} runs on the distributed runner: add --ranks K (the "
            "single-process GPipe runs the gpipe schedule only)"
        )
    if virtual is not None and placed:
        raise ValueError(
            f"--schedule {schedule} places 2 stages on each rank itself (rank r holds stages "
            "r and 2K-1-r): leave out --virtual-stages"
        )
    if virtual is not None and not args.ranks:
        raise ValueError(
            f"--virtual-stages {virtual} runs on the distributed runner: add --ranks K (the "
            "single-process GPipe runs one stage per device)"
        )
    if placed and args.checkpoint not in (None, "never"):
        raise ValueError(
            f"--schedule {schedule} runs on the distributed runner, which re-computes "
            "nothing under a split backward (torch re-runs a checkpointed forward in each "
            f"of its parts): --checkpoint {args.checkpoint} is not supported; leave it out "
            "or give never"
        )
    return 2 if placed else virtual or 1


def check_chunks(schedule: str, ranks: int, per_rank: int, chunks: int) -> None:
    """Refuses micro-batch counts torch's schedules cannot run on ``ranks`` ranks holding
    ``per_rank`` stages each, before any rank starts.

    Raises:
        ValueError: a V schedule with fewer micro-batches than its 2K stages (DualPipeV's
            bound, which the runner holds ZBV to as well), or interleaved 1F1B with a count
            its rounds of about K micro-batches do not divide.
    """
    if schedule in V_SCHEDULES and chunks < 2 * ranks:
        raise ValueError(
            f"--schedule {schedule} needs at least as many micro-batches as its {2 * ranks} "
            f"stages on {ranks} ranks, got {chunks}: give --chunks {2 * ranks} or more"
        )
    rounds = max(1, chunks // ranks)
    if schedule == "1f1b" and per_rank > 1 and chunks % rounds:
        raise ValueError(
            f"interleaved 1f1b runs the micro-batches in rounds of about K = {ranks} and "
            f"needs a multiple of the {rounds} rounds, got {chunks}: give --chunks as a "
            f"multiple of {ranks}, or --schedule gpipe"
        )


def given_balance(text: str | None, stages: int, units: int, per_rank: int = 1) -> list[int] | None:
    """The ``--balance`` split, checked against the stage and unit counts (``None``: none);
    ``stages`` counts every stage, ``per_rank`` of them on each rank."""
    if text is None:
        return None
    try:
        balance = [int(part) for part in text.split(",")]
    except ValueError:
        balance = []
    if not balance or min(balance) < 1:
        raise ValueError(f"--balance expects positive unit counts such as 3,5,4, got {text!r}")
    if len(balance) != stages:
        where = (
            f"--stages is {stages}"
            if per_rank == 1
            else f"there are {stages} ({per_rank} on each of {stages // per_rank} ranks)"
        )
        raise ValueError(
            f"--balance {text} has {len(balance)} stages but {where}; give one unit count "
            "per stage, in stage order"
        )
    if sum(balance) != units:
        raise ValueError(
            f"--balance {text} sums to {sum(balance)} but the model has {units} units; "
            f"give counts summing to {units}"
        )
    return balance


def profile_args(args: argparse.Namespace) -> argparse.Namespace:
    """The options :func:`read_profile` reads, with the profiling ones of this command."""
    values = {**vars(args), "repeats": args.profile_repeats, "warmup": args.profile_warmup}
    values.update(batch=None, autocast=None)
    return argparse.Namespace(**values)


def gpipe_devices(args: argparse.Namespace, stages: int) -> list[str]:
    """One device per stage for the single-process runs: ``--device`` for every stage, or
    on CUDA the GPUs in turn."""
    device: str = args.device or default_device()
    if not device.startswith("cuda"):
        return [device] * stages
    import torch

    count = torch.cuda.device_count()
    return [f"cuda:{k % count}" for k in range(stages)]
