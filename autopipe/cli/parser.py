"""The ``autopipe`` argument parser: the commands, their options, and which command runs."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any, NoReturn

from autopipe import __version__
from autopipe.cli.arguments import add_measure_options, add_tracing_options, positive
from autopipe.cli.bench_command import add_bench_parser
from autopipe.cli.calibrate_command import calibrate_command
from autopipe.cli.plan_command import plan_command
from autopipe.cli.profile_command import profile_command
from autopipe.cli.search_command import search_command
from autopipe.cli.target import add_target_options
from autopipe.planning import ALL_SCHEDULES, CHECKPOINT_MODES, CHUNKS_PER_STAGE, STRATEGIES

__all__: list[str] = []  # internal to the command line

Command = Callable[[argparse.Namespace], int]

PROG = "autopipe"

_MODEL_HELP = (
    "model.py must define `model`, any nn.Module (or a function returning one: an "
    "nn.Sequential is split between its children, any other module is traced and cut into "
    "units), and `sample`, the mini-batch to plan for: a tensor or tuple of positional input "
    "tensors with the batch in dim 0 (or a function returning one); it may define `kwargs`, "
    "the model's keyword inputs (a dict, or a function returning one). See examples/mlp.py."
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, like every other error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes `-5GiB` for an option (only plain numbers such as `-5` read as
        # values), so `--memory -5GiB` would fail as a missing value; read anything that
        # starts like a negative number as a value, which the option then refuses.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


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
    # In this order in `autopipe --help`.
    _add_plan_parser(commands)
    _add_calibrate_parser(commands)
    _add_profile_parser(commands)
    add_bench_parser(commands, _MODEL_HELP)
    return parser


def selected_command(args: argparse.Namespace) -> Command:
    """The command the parsed ``args`` ask for: ``plan --search`` runs the search.

    Raises:
        ValueError: an option of the search without ``--search``.
    """
    if args.command == "plan" and args.search:
        if args.export:
            raise ValueError(
                "--export goes with a plan of --stages; with --search, save the best plan "
                "with --json and export it in Python: Plan.load(FILE).export(FORMAT)"
            )
        return search_command
    if args.command == "plan" and args.shard_optimizer:
        raise ValueError(
            "--shard-optimizer goes with --search: a plan of --stages has one replica, "
            "with no copies to shard the optimizer state over"
        )
    command: Command = args.func
    return command


# ----------------------------------------------------------------------------------------
# The commands.


def _add_plan_parser(commands: Any) -> None:
    """``autopipe plan``, with the options of ``--search``."""
    parser = commands.add_parser(
        "plan",
        help="profile a model and print the fastest pipeline split that fits",
        description="Profile the layers of MODEL.py (or load --profile FILE) and print the "
        "pipeline split with the smallest predicted step time, compared with an equal "
        "split of the layer count.",
        epilog=_MODEL_HELP,
    )
    parser.add_argument(
        "model",
        nargs="?",
        metavar="MODEL.py",
        help="the model file; optional with --profile, and then checked against it",
    )
    parser.add_argument(
        "--stages",
        type=positive,
        metavar="K",
        help="pipeline stages (default: the number of visible GPUs when at least 2, else 2)",
    )
    add_measure_options(
        parser,
        f"micro-batches per mini-batch (default: {CHUNKS_PER_STAGE} x stages, GPipe's rule "
        "of thumb for a small bubble, with at least 2 samples each where the batch allows)",
    )
    parser.add_argument(
        "--memory",
        metavar="SIZE[,SIZE...]",
        help="memory per device, e.g. 16GiB, or a comma list with one size per stage "
        "(default: unlimited)",
    )
    parser.add_argument(
        "--checkpoint",
        choices=CHECKPOINT_MODES,
        help="activation checkpointing; auto checkpoints only the stages that do not fit "
        "otherwise (default: except_last; never with --virtual-stages, whose schedules keep "
        "every activation; with --search: all modes)",
    )
    parser.add_argument(
        "--recompute-norms",
        nargs="?",
        const="on",
        choices=("on", "auto"),
        help="plan the layers' LayerNorm/RMSNorm outputs re-computed in the backward, not "
        "kept (Megatron-LM's --recompute-modules layernorm); auto (with --search): weigh "
        "both; planned and exported to Megatron-LM, not run by autopipe's runners",
    )
    parser.add_argument(
        "--recompute-up-proj",
        action="store_true",
        help="plan a latent attention's (DeepSeek's MLA) queries, keys and values "
        "re-built from its latents in the backward, not kept (Megatron-LM's "
        "--recompute-modules mla_up_proj); planned and exported to Megatron-LM, not run "
        "by autopipe's runners",
    )
    parser.add_argument(
        "--schedule",
        choices=ALL_SCHEDULES,
        help="pipeline schedule (default: gpipe; with --search: gpipe and 1f1b); zb is "
        "torch's zero-bubble schedule, zbv and dualpipev its V-shaped ones (2 stages per "
        "device: device r holds stages r and 2K-1-r) (the distributed runner; checkpoint "
        "never)",
    )
    parser.add_argument(
        "--virtual-stages",
        type=positive,
        default=1,
        metavar="V",
        help="stages per device, run by an interleaved schedule: plans K x V stages, stage s "
        "on device s mod K (default: 1); with --search: consider 1 to V per device",
    )
    parser.add_argument(
        "--one-device",
        action="store_true",
        help="every stage on the profile's one device in one process (autopipe.GPipe on "
        "['cpu', 'cpu']): the stages take turns, so the step is M x their summed time, every "
        "split takes as long and the one needing the least memory per stage is chosen; "
        "with --search, up to --devices stages on it, one replica, gpipe",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="optimal",
        help="how to split (default: optimal); the others are baselines for comparison",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        help="optimizer whose state counts toward memory: adam, adamw, sgd, momentum, none, "
        "their mixed-precision forms adam-mixed, adamw-mixed, sgd-mixed, momentum-mixed "
        "(float32 master weights and state for 2-byte parameters: adam-mixed is 16 bytes "
        "per parameter in all), or state bytes per parameter byte (default: adam)",
    )
    parser.add_argument(
        "--bandwidth",
        metavar="BYTES_PER_S",
        help="link bandwidth between stages, e.g. 10GB or 10GB/s (default: free transfers)",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="plan from a profile saved by `autopipe profile` instead of profiling",
    )
    parser.add_argument(
        "--json",
        metavar="FILE",
        help="also write the plan as JSON; its `balance` lists the layers per stage",
    )
    parser.add_argument(
        "--export",
        action="append",
        metavar="FORMAT[=FILE]",
        help="also write the split for another runtime, to FILE or stdout (the report then "
        "goes to stderr); repeatable. FORMAT: torch (pipeline()'s split_spec, Python), "
        "torch-json, torchtitan (module_fqns_per_model_part, TOML), torchtitan-json, "
        "megatron (--pipeline-model-parallel-layout), deepspeed (PipelineModule parts, JSON)",
    )
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="also draw the plan's simulated pipeline schedule as a Gantt chart, one row per "
        "device (.png or .svg; needs matplotlib)",
    )
    parser.add_argument(
        "--compare",
        metavar="FILE",
        help="also draw every strategy's stage times side by side, to see how balanced "
        "each split is (.png or .svg; needs matplotlib)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="also write the plan's simulated pipeline step as a Chrome trace (.json), one "
        "track per device, to open in ui.perfetto.dev or chrome://tracing",
    )
    add_tracing_options(parser)
    add_target_options(parser)
    _add_search_options(parser)
    parser.set_defaults(func=plan_command)


def _add_search_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``autopipe plan --search``."""
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
        "--devices", type=positive, metavar="N", help="devices to use (default: as --stages)"
    )
    search.add_argument(
        "--batch",
        type=positive,
        metavar="B",
        help="samples per step, across replicas with --search (default: the sample's)",
    )
    search.add_argument(
        "--top", type=positive, default=10, metavar="T", help="rows to print (default: 10)"
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
    search.add_argument(
        "--shard-optimizer",
        action="store_true",
        help="shard each stage's optimizer state over its data-parallel replicas (ZeRO-1, "
        "DeepSpeed stage 1, Megatron-LM's distributed optimizer): a stage holds 1/D of it, "
        "at the same step time",
    )
    _add_mesh_options(search)


def _degrees(text: str) -> tuple[int, ...]:
    """A comma list of positive integers, or ``auto`` (the empty tuple)."""
    if text.strip().lower() == "auto":
        return ()
    try:
        return tuple(positive(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected positive integers such as 1,2,4,8 (or auto), got {text!r}"
        ) from None


def _zero_stages(text: str) -> tuple[int, ...]:
    """A comma list of ZeRO stages (0 to 3)."""
    parts = text.split(",")
    if not all(part.strip() in ("0", "1", "2", "3") for part in parts):
        raise argparse.ArgumentTypeError(f"expected ZeRO stages among 0,1,2,3, got {text!r}")
    return tuple(int(part) for part in parts)


def _add_mesh_options(search: Any) -> None:
    """The mesh options of ``--search``: any of them makes every configuration take all
    ``--devices`` (t x c x K x D = N)."""
    search.add_argument(
        "--tensor-parallel",
        type=_degrees,
        metavar="T[,T...]",
        help="tensor-parallel degrees to weigh, or auto: every degree up to --per-node "
        "that the attention heads divide (needs a profile counted with a tensor-parallel "
        "plan)",
    )
    search.add_argument(
        "--context-parallel",
        type=_degrees,
        metavar="C[,C...]",
        help="context-parallel degrees to weigh (each sample's sequence split over C)",
    )
    search.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="weigh sequence parallelism too, with every tensor-parallel degree above 1",
    )
    search.add_argument(
        "--zero",
        type=_zero_stages,
        metavar="Z[,Z...]",
        help="ZeRO stages to weigh over the replicas: 0 none, 1 optimizer state, 2 and "
        "gradients, 3 and parameters (e.g. 1,3)",
    )
    search.add_argument(
        "--expert-parallel",
        type=_degrees,
        metavar="E[,E...]",
        help="expert-parallel degrees to weigh for a profile with routed experts, or auto "
        "(every degree dividing D x c and the experts); carved from the data x context "
        "ranks",
    )
    search.add_argument(
        "--pipeline-parallel",
        type=_degrees,
        metavar="K[,K...]",
        help="pipeline depths (ranks per pipeline) to weigh, e.g. a published run's "
        "(default: every depth the devices allow)",
    )
    search.add_argument(
        "--global-batch",
        type=positive,
        metavar="B",
        help="samples per step across every replica (the same as --batch)",
    )
    search.add_argument(
        "--micro-batch",
        type=positive,
        metavar="b",
        help="samples per micro-batch; M follows: global batch / (D x b)",
    )
    search.add_argument(
        "--sequence",
        type=positive,
        metavar="S",
        help="tokens per sample: the model file's sample of token ids is rebuilt at S "
        "tokens before it is counted, and the tokens per second per GPU follow",
    )


def _add_calibrate_parser(commands: Any) -> None:
    """``autopipe calibrate``."""
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
        "--repeats", type=positive, default=10, metavar="N", help="timed runs (default: 10)"
    )
    parser.add_argument(
        "--model",
        metavar="MODEL.py",
        help="the profiled model file: also time its whole training step and store how much "
        "longer its layers run there than alone (compute_scale)",
    )
    add_tracing_options(parser)
    parser.set_defaults(func=calibrate_command)


def _add_profile_parser(commands: Any) -> None:
    """``autopipe profile``."""
    parser = commands.add_parser(
        "profile",
        help="profile a model and save the measurements for `autopipe plan --profile`",
        description="Measure the time and memory of every layer of MODEL.py and save them.",
        epilog=_MODEL_HELP,
    )
    parser.add_argument("model", metavar="MODEL.py", help="the model file")
    parser.add_argument(
        "-o", "--output", required=True, metavar="FILE", help="where to write the profile (JSON)"
    )
    add_measure_options(
        parser,
        f"micro-batches the profile is made for (default: {CHUNKS_PER_STAGE} x the default "
        "stage count, with at least 2 samples each where the batch allows)",
    )
    add_tracing_options(parser)
    parser.set_defaults(func=profile_command)
