"""The ``autopipe`` command line: the parser, option values, model loading, ``profile``.

The commands live in :mod:`autopipe.cli.plan` (``plan``) and :mod:`autopipe.cli.search`
(``plan --search``, ``calibrate``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from autopipe import __version__
from autopipe.cli.plan import plan_command
from autopipe.cli.search import add_calibrate_parser, add_search_options
from autopipe.planning.cost_model import optimizer_factor
from autopipe.planning.names import ALL_SCHEDULES, CHECKPOINT_MODES, STRATEGIES
from autopipe.planning.planner import CHUNKS_PER_STAGE, default_chunks
from autopipe.planning.quantities import parse_bytes, parse_rate
from profiler.precision import AUTOCAST_DTYPES, DTYPES, check_autocast, check_dtype

if TYPE_CHECKING:
    from torch import nn

    from autopipe.cli.model_file import Sample
    from autopipe.planning.plans import Plan
    from profiler.profile import Profile

__all__ = ["add_tracing_options", "build_parser", "default_chunks", "main"]

PROG = "autopipe"
# autopipe.graph.units.GRANULARITIES, which imports torch; the tests keep both equal.
GRANULARITIES = ("children", "blocks", "leaves")

_MODEL_HELP = (
    "model.py must define `model`, any nn.Module (or a function returning one: an "
    "nn.Sequential is split between its children, any other module is traced and cut into "
    "units), and `sample`, the mini-batch to plan for: a tensor or tuple of positional input "
    "tensors with the batch in dim 0 (or a function returning one); it may define `kwargs`, "
    "the model's keyword inputs (a dict, or a function returning one). See examples/mlp.py."
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:  # planning from a saved profile needs no torch
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_stages() -> int:
    """The number of visible GPUs when there are at least two, else 2."""
    count = _gpu_count()
    return count if count >= 2 else 2


def default_device() -> str:
    """``cuda:0`` when CUDA is available, else ``cpu``."""
    return "cuda:0" if _gpu_count() > 0 else "cpu"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected module names such as a,b.c, got {text!r}")
    return names


def add_tracing_options(parser: argparse.ArgumentParser) -> None:
    """``--granularity`` and ``--leaf-modules``: how a model that is no nn.Sequential is cut."""
    parser.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        help="where a traced model (not an nn.Sequential) may be cut: between its direct "
        "children (children), between repeated blocks such as a transformer's layers and "
        "the modules around them (blocks, the default), or between all modules without "
        "children (leaves)",
    )
    parser.add_argument(
        "--leaf-modules",
        type=_names,
        default=[],
        metavar="NAME[,NAME...]",
        help="submodules of a traced model, by path (e.g. encoder.layer.0), that torch.fx "
        "keeps as single calls, for code it cannot trace through",
    )


def _add_measure_options(parser: argparse.ArgumentParser, chunks_help: str) -> None:
    parser.add_argument(
        "--device",
        help="where to profile the layers (default: cuda:0 when CUDA is available, else cpu)",
    )
    parser.add_argument("--chunks", type=_positive, metavar="M", help=chunks_help)
    parser.add_argument(
        "--repeats",
        type=_positive,
        default=5,
        metavar="N",
        help="timed runs per layer and batch size; the median is kept (default: 5)",
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        default=2,
        metavar="N",
        help="untimed runs per layer and batch size before timing (default: 2)",
    )
    # Checked by the commands rather than by `choices`, so a bad value is one error line.
    parser.add_argument(
        "--autocast",
        metavar="{" + ",".join(AUTOCAST_DTYPES) + "}",
        help="run every forward and backward under torch.autocast with this dtype, as "
        "mixed-precision training does (default: none; on the CPU prefer bfloat16)",
    )
    parser.add_argument(
        "--dtype",
        metavar="{" + ",".join(DTYPES) + "}",
        help="cast the model's parameters and buffers and the sample's floating tensors "
        "to this dtype before profiling (default: as model.py defines them)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``autopipe`` command."""
    parser = _Parser(
        prog=PROG,
        description="Automatic pipeline-parallel training for PyTorch: profile a model "
        "layer by layer and split it into balanced pipeline stages.",
        epilog=_MODEL_HELP,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan_parser = commands.add_parser(
        "plan",
        help="profile a model and print the fastest pipeline split that fits",
        description="Profile the layers of MODEL.py (or load --profile FILE) and print the "
        "pipeline split with the smallest predicted step time, compared with an equal "
        "split of the layer count.",
        epilog=_MODEL_HELP,
    )
    plan_parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL.py",
        help="the model file; optional with --profile, and then checked against it",
    )
    plan_parser.add_argument(
        "--stages",
        type=_positive,
        metavar="K",
        help="pipeline stages (default: the number of visible GPUs when at least 2, else 2)",
    )
    _add_measure_options(
        plan_parser,
        f"micro-batches per mini-batch (default: {CHUNKS_PER_STAGE} x stages, GPipe's rule "
        "of thumb for a small bubble, with at least 2 samples each where the batch allows)",
    )
    plan_parser.add_argument(
        "--memory",
        metavar="SIZE[,SIZE...]",
        help="memory per device, e.g. 16GiB, or a comma list with one size per stage "
        "(default: unlimited)",
    )
    plan_parser.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_MODES,
        help="activation checkpointing; auto checkpoints only the stages that do not fit "
        "otherwise (default: except_last; never with --virtual-stages, whose schedules keep "
        "every activation; with --search: all modes)",
    )
    plan_parser.add_argument(
        "--schedule",
        choices=ALL_SCHEDULES,
        help="pipeline schedule (default: gpipe; with --search: gpipe and 1f1b); zb is "
        "torch's zero-bubble schedule (the distributed runner; checkpoint never)",
    )
    plan_parser.add_argument(
        "--virtual-stages",
        type=_positive,
        default=1,
        metavar="V",
        help="stages per device, run by an interleaved schedule: plans K x V stages, stage s "
        "on device s mod K (default: 1); with --search: consider 1 to V per device",
    )
    plan_parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="optimal",
        help="how to split (default: optimal); the others are baselines for comparison",
    )
    plan_parser.add_argument(
        "--optimizer",
        default="adam",
        help="optimizer whose state counts toward memory: adam, adamw, sgd, momentum, none, "
        "or state bytes per parameter byte (default: adam)",
    )
    plan_parser.add_argument(
        "--bandwidth",
        metavar="BYTES_PER_S",
        help="link bandwidth between stages, e.g. 10GB or 10GB/s (default: free transfers)",
    )
    plan_parser.add_argument(
        "--profile",
        metavar="FILE",
        help="plan from a profile saved by `autopipe profile` instead of profiling",
    )
    plan_parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the plan as JSON; its `balance` lists the layers per stage",
    )
    plan_parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="also draw the plan's simulated pipeline schedule as a Gantt chart, one row per "
        "device (.png or .svg; needs matplotlib)",
    )
    plan_parser.add_argument(
        "--compare",
        metavar="FILE",
        help="also draw every strategy's stage times side by side, to see how balanced "
        "each split is (.png or .svg; needs matplotlib)",
    )
    add_tracing_options(plan_parser)
    add_search_options(plan_parser)
    plan_parser.set_defaults(func=plan_command)

    add_calibrate_parser(commands)

    profile_parser = commands.add_parser(
        "profile",
        help="profile a model and save the measurements for `autopipe plan --profile`",
        description="Measure the time and memory of every layer of MODEL.py and save them.",
        epilog=_MODEL_HELP,
    )
    profile_parser.add_argument("model", metavar="MODEL.py", help="the model file")
    profile_parser.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="where to write the profile (JSON)"
    )
    _add_measure_options(
        profile_parser,
        f"micro-batches the profile is made for (default: {CHUNKS_PER_STAGE} x the default "
        "stage count, with at least 2 samples each where the batch allows)",
    )
    add_tracing_options(profile_parser)
    profile_parser.set_defaults(func=_profile_command)
    return parser


# ----------------------------------------------------------------------------------------
# Option parsing beyond argparse: errors here are one-line `autopipe: error:` messages.


def _memory(text: str | None) -> int | list[int] | None:
    if text is None:
        return None
    if "," in text:
        return [parse_bytes(part) for part in text.split(",")]
    return parse_bytes(text)


def _bandwidth(text: str | None) -> float | None:
    if text is None:
        return None
    return parse_rate(text)


def _optimizer(text: str) -> str | float:
    try:
        value: str | float = float(text)
    except ValueError:
        value = text
    optimizer_factor(value)  # raises ValueError naming the choices
    return value


def _check_writable(path: str, what: str) -> None:
    """Fails early, before a long profile, when ``path`` cannot be written."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise ValueError(f"cannot write the {what} to {path}: it is a directory")
    if not parent.is_dir():
        raise ValueError(f"cannot write the {what} to {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"cannot write the {what} to {path}: directory {parent} is not writable")


def _check_picture(path: str, what: str) -> None:
    """Fails early, before a long profile, when a picture cannot be drawn to ``path``."""
    from autopipe.planning.timeline import check_picture_path, require_matplotlib

    check_picture_path(path, what)
    _check_writable(path, what)
    try:
        require_matplotlib()
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def _save(obj: Plan | Profile, path: str, what: str) -> None:
    try:
        obj.save(path)
    except OSError as exc:
        raise ValueError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None


# ----------------------------------------------------------------------------------------
# Commands.


def _check_precision(args: argparse.Namespace) -> None:
    """Fails early, before loading the model, on a bad ``--autocast``, ``--dtype`` or
    ``--device`` (checked when the layers are to be measured, not with ``--profile``)."""
    check_autocast(args.autocast, "--autocast")
    if args.dtype is not None:
        check_dtype(args.dtype, "--dtype")
    if args.device is not None and not getattr(args, "profile", None):
        from autopipe.cli.checks import check_device

        args.device = check_device(args.device)


def _load_profile(args: argparse.Namespace) -> Profile:
    """The ``--profile`` file, which must have been measured as ``--autocast``/``--dtype`` say."""
    from profiler.profile import Profile

    profile = Profile.load(args.profile)
    given = {
        "--autocast": (args.autocast, profile.autocast),
        "--dtype": (args.dtype, profile.dtype),
    }
    for option, (wanted, found) in given.items():
        if wanted is not None and wanted != found:
            raise ValueError(
                f"{args.profile} was profiled with {option[2:]} {found or 'none'}, not "
                f"{option} {wanted}: profile again with it, or leave out {option}"
            )
    return profile


def _load(
    args: argparse.Namespace, dtype: str | None = None, path: str | None = None
) -> tuple[nn.Sequential, Sample]:
    """The model file (``path``, default ``args.model``) split as ``--granularity`` says."""
    from autopipe.cli.model_file import load_sequential

    return load_sequential(
        path or args.model,
        dtype,
        granularity=args.granularity,
        leaf_modules=args.leaf_modules,
    )


def _load_matching(
    args: argparse.Namespace, profile: Profile, profile_path: str, path: str
) -> tuple[nn.Sequential, Sample]:
    """The model file ``path``, cast as the profile was, refused if it has other layers."""
    from autopipe.cli.checks import check_profile_matches

    # A profile made with --dtype measured the cast model: compare with that one.
    cast = profile.dtype if profile.dtype in DTYPES and profile.dtype != "float32" else None
    model, sample = _load(args, cast, path)
    check_profile_matches(profile, model, profile_path, path)
    return model, sample


def _measure(
    model: nn.Sequential, sample: Sample, args: argparse.Namespace, chunks: int
) -> Profile:
    """Profiles ``model``, reporting progress on stderr and failures as one line."""
    from profiler.measure import profile_model
    from profiler.progress import TerminalProgress

    children = list(model.named_children())
    show = TerminalProgress(kinds={name: type(child).__name__ for name, child in children})
    done = 0

    def progress(count: int, total: int, name: str) -> None:
        nonlocal done
        done = count
        show(count, total, name)

    try:
        return profile_model(
            model,
            sample,
            device=args.device or default_device(),
            chunks=chunks,
            warmup=args.warmup,
            repeats=args.repeats,
            progress=progress,
            autocast=args.autocast,
        )
    except ValueError:
        raise
    except Exception as exc:
        if show.enabled() and done:
            show.stream.write("\n")
        name, child = children[min(done, len(children) - 1)]
        message = " ".join(str(exc).split())
        raise ValueError(
            f"profiling layer {done} ({name}: {type(child).__name__}) failed: "
            f"{type(exc).__name__}: {message}"
        ) from None


def _batch_size(sample: Sample) -> int:
    first = sample[0] if isinstance(sample, tuple) else sample
    return int(first.shape[0])


def _profile_command(args: argparse.Namespace) -> int:
    from autopipe.planning.report import precision_label

    _check_precision(args)
    _check_writable(args.output, "profile")
    model, sample = _load(args, args.dtype)
    chunks = args.chunks or default_chunks(default_stages(), _batch_size(sample))
    profile = _measure(model, sample, args, chunks)
    _save(profile, args.output, "profile")
    precision = precision_label({"dtype": profile.dtype, "autocast": profile.autocast})
    print(
        f"profiled {len(profile)} layers on {profile.device}"
        f"{f' ({precision})' if precision else ''} at micro-batch sizes "
        f"{profile.batch_sizes}; wrote {args.output}"
    )
    return 0


def _fail(message: str) -> int:
    line = " ".join(message.split()) or "failed"
    print(f"{PROG}: error: {line}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``autopipe`` command.

    Args:
        argv: the arguments after the program name; default: ``sys.argv[1:]``.

    Returns:
        The exit status: 0 on success, 2 for bad input (usage errors included), with a
        one-line ``autopipe: error:`` message on stderr; 130 when interrupted.
    """
    # Everything runs inside the handlers, the parser and the lazy imports of torch and
    # scipy included: a Ctrl-C at any point is one line, and files are written atomically.
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, or a usage error argparse has reported
            return exc.code if isinstance(exc.code, int) else 2
        status: int = args.func(args)
    except KeyboardInterrupt:
        # A progress line may be open on a terminal: end it first.
        start = "\n" if sys.stderr.isatty() else ""
        print(f"{start}{PROG}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as exc:  # ModelFileError and PlanningError included
        return _fail(str(exc))
    return status
