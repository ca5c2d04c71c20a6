"""What the commands share before any long work: defaults, option values, output checks.

Errors are ``ValueError``s whose message :mod:`autopipe.cli.entry` prints as one
``autopipe: error:`` line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autopipe.planning import optimizer_factor, parse_bytes, parse_rate
from profiler import check_autocast, check_dtype

if TYPE_CHECKING:
    from autopipe.planning import Plan
    from profiler import Profile

__all__: list[str] = []  # internal to the command line


def _gpu_count() -> int:
    try:
        from profiler import gpu_count  # loads torch
    except ImportError:  # planning from a saved profile needs no torch
        return 0
    return gpu_count()


def default_stages() -> int:
    """The number of visible GPUs when there are at least two, else 2."""
    count = _gpu_count()
    return count if count >= 2 else 2


def default_device() -> str:
    """``cuda:0`` when CUDA is available, else ``cpu`` (the rule of :mod:`profiler.devices`
    in a process that has not chosen another CUDA device)."""
    return "cuda:0" if _gpu_count() > 0 else "cpu"


# ----------------------------------------------------------------------------------------
# Option values argparse does not check, so that a bad one is an `autopipe: error:` line.


@dataclass(frozen=True)
class CostOptions:
    """The values of the options the cost model reads."""

    memory: int | list[int] | None
    bandwidth: float | None
    allreduce_bandwidth: float | None
    optimizer: str | float


def cost_options(args: argparse.Namespace, *, memory_per_stage: bool = True) -> CostOptions:
    """``--memory``, ``--bandwidth``, ``--allreduce-bandwidth`` and ``--optimizer``.

    Args:
        args: the parsed arguments of ``autopipe plan``.
        memory_per_stage: whether ``--memory`` may list one size per stage; not with
            ``--search``, which chooses the stage count itself.
    """
    memory = _memory(args.memory)
    if isinstance(memory, list) and not memory_per_stage:
        raise ValueError("--search needs one --memory size, the same for every device")
    return CostOptions(
        memory=memory,
        bandwidth=_bandwidth(args.bandwidth),
        allreduce_bandwidth=_bandwidth(args.allreduce_bandwidth),
        optimizer=_optimizer(args.optimizer),
    )


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


def tp_plan_option(args: argparse.Namespace) -> dict[str, str] | None:
    """The ``--tp-plan`` file's plan, ``None`` without the option (and for commands that
    lack it).

    Raises:
        ValueError: the file cannot be read or is no plan (one line saying why).
    """
    path = getattr(args, "tp_plan", None)
    if path is None:
        return None
    from autopipe.graph import read_tp_plan  # loads torch, which a saved profile needs not

    return read_tp_plan(path)


def expert_skew(args: argparse.Namespace) -> float:
    """``--expert-skew``, 1 (balanced routing) without it and for commands that lack it."""
    value = getattr(args, "expert_skew", None)
    return 1.0 if value is None else float(value)


def check_precision(args: argparse.Namespace) -> None:
    """Fails early, before loading the model, on a bad ``--autocast``, ``--dtype`` or
    ``--device`` (checked when the layers are to be measured, not with ``--profile``)."""
    check_autocast(args.autocast, "--autocast")
    if args.dtype is not None:
        check_dtype(args.dtype, "--dtype")
    if args.device is not None and not getattr(args, "profile", None):
        from autopipe.cli.checks import check_device

        args.device = check_device(args.device)


# ----------------------------------------------------------------------------------------
# Outputs: checked before a long profile, written so that a failure is one line.


def check_writable(path: str, what: str) -> None:
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
    from autopipe.output import check_picture_path, require_matplotlib

    check_picture_path(path, what)
    check_writable(path, what)
    try:
        require_matplotlib()
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def check_plan_outputs(args: argparse.Namespace) -> None:
    """Fails early when the ``--json`` plan, a ``--timeline``/``--compare`` picture or the
    ``--trace`` cannot be written."""
    if args.json:
        check_writable(args.json, "plan")
    if args.timeline:
        _check_picture(args.timeline, "timeline")
    if args.compare:
        _check_picture(args.compare, "comparison")
    if getattr(args, "trace", None):
        from autopipe.output import check_trace_path

        check_trace_path(args.trace)


def save(obj: Plan | Profile, path: str, what: str) -> None:
    """Writes a plan or profile to ``path``; a failure is a ``ValueError`` naming it."""
    try:
        obj.save(path)
    except OSError as exc:
        raise ValueError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from None
