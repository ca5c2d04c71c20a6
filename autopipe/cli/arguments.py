"""The argument types and the option groups that more than one ``autopipe`` command has."""

from __future__ import annotations

import argparse
import math

from profiler import AUTOCAST_DTYPES, DTYPES

__all__: list[str] = []  # internal to the command line

# autopipe.graph.units.GRANULARITIES, which imports torch; the tests keep both equal.
GRANULARITIES = ("children", "blocks", "leaves")


def positive(text: str) -> int:
    """An option value that must be an integer of at least 1."""
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


def _skew(text: str) -> float:
    """``--expert-skew``: a finite number of at least 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(
            f"expected a number >= 1 (the busiest expert's tokens over the mean; 1: "
            f"balanced), got {text!r}"
        )
    return value


def _names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected module names such as a,b.c, got {text!r}")
    return names


def add_measure_options(parser: argparse.ArgumentParser, chunks_help: str) -> None:
    """How the layers are measured: device, micro-batches, repeats, precision."""
    parser.add_argument(
        "--device",
        help="where to profile the layers (default: cuda:0 when CUDA is available, else cpu)",
    )
    parser.add_argument("--chunks", type=positive, metavar="M", help=chunks_help)
    parser.add_argument(
        "--repeats",
        type=positive,
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
    parser.add_argument(
        "--tp-plan",
        metavar="FILE",
        help="a tensor-parallel plan (JSON object of module-name patterns, `*` for one part, "
        "to styles such as colwise and rowwise) whose sharded FLOPs, bytes and collectives "
        "are counted per layer (default: a Hugging Face model's own plan with --target, "
        "else none)",
    )
    parser.add_argument(
        "--expert-skew",
        type=_skew,
        metavar="S",
        help="the routing assumed where a mixture of experts is counted on fake tensors, "
        "which have no values to route by: the busiest routed expert receives S times the "
        "mean of the routed tokens, the others share the rest evenly (default: 1, "
        "balanced top-k)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="measure again and leave the profile cache alone (default: a model file "
        "measured before with the same code, structure, shapes, options and versions is "
        "planned from its cached profile, in $AUTOPIPE_CACHE_DIR, else "
        "$XDG_CACHE_HOME/autopipe, else ~/.cache/autopipe)",
    )


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
