"""The profile a command plans from: the ``--profile`` file, or the model file's layers measured."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopipe.cli.model_output import model_output_to_stderr
from autopipe.cli.options import default_device, expert_skew, tp_plan_option
from autopipe.planning import default_chunks
from profiler import DTYPES

if TYPE_CHECKING:
    from torch import nn

    from autopipe.cli.model_file import Sample
    from profiler import Profile, TerminalProgress

__all__: list[str] = []  # internal to the command line


@dataclass(frozen=True)
class Inputs:
    """The profile a command plans from.

    Attributes:
        profile: the layers' measurements.
        batch: samples per step: ``--batch``, else with ``--profile`` the model file's
            sample when one is given; ``None``: the profile's.
        chunks: the micro-batch count the layers were just measured for; ``None`` for a
            loaded profile.
    """

    profile: Profile
    batch: int | None
    chunks: int | None


def read_profile(
    args: argparse.Namespace,
    stages: int,
    *,
    measure_batch: int | None = None,
    check_model: Callable[[int], None] | None = None,
) -> Inputs:
    """The ``--profile`` file (checked against the model file if one is given), or the
    model file's layers measured as :func:`measure_model` does; what the model prints
    goes to stderr."""
    with model_output_to_stderr():
        return _read_profile(args, stages, measure_batch, check_model)


def _read_profile(
    args: argparse.Namespace,
    stages: int,
    measure_batch: int | None,
    check_model: Callable[[int], None] | None,
) -> Inputs:
    if args.profile:
        if getattr(args, "tp_plan", None):
            raise ValueError(
                "--tp-plan is counted while profiling: profile the model file with it "
                "(autopipe profile MODEL.py --tp-plan FILE) and plan from that, or leave "
                "out --profile"
            )
        profile = _load_profile(args)
        batch = args.batch
        if args.model:  # the plan is for its sample's batch, unless --batch says otherwise
            _, sample = load_matching(args, profile, args.profile, args.model)
            batch = batch or _batch_size(sample)
        return Inputs(profile, batch, None)
    if args.model:
        profile, chunks = measure_model(args, stages, batch=measure_batch, check_model=check_model)
        return Inputs(profile, args.batch, chunks)
    raise ValueError("give a model file (autopipe plan MODEL.py) or --profile FILE")


def measure_model(
    args: argparse.Namespace,
    stages: int,
    *,
    batch: int | None = None,
    check_model: Callable[[int], None] | None = None,
) -> tuple[Profile, int]:
    """Profiles the layers of the model file, cast to ``--dtype``.

    Args:
        args: the parsed arguments; ``model`` names the model file.
        stages: the stage count whose default micro-batch count the layers are measured
            for, unless ``--chunks`` gives it.
        batch: the mini-batch split into those micro-batches; default: the sample's.
        check_model: called with the model's layer count before it is measured (or planned
            from the cache), to refuse it before a long profile.

    Returns:
        The profile and the micro-batch count it was measured for.
    """
    from autopipe.cli.cache import cache_entry
    from autopipe.cli.model_file import as_sequential, cast_loaded, load_model_file
    from autopipe.cli.source_index import recording, source_entry

    device = args.device or default_device()
    plan = tp_plan_option(args)  # a bad file fails before the model loads
    index = source_entry(args, device)
    if index is not None:  # the model file need not run when nothing it read changed
        found = index.lookup(stages, batch)
        if found is not None:
            known, count, where = found
            if check_model is not None:
                check_model(len(known))
            print(f"profile: cached ({where}; the model file did not run)", file=sys.stderr)
            return known, count
    with model_output_to_stderr():  # the model's prints are not the command's output
        with recording() as reads:
            loaded = load_model_file(args.model)
        if getattr(args, "sequence", None) is not None:
            from autopipe.cli.sequence_length import at_sequence

            loaded = at_sequence(loaded, args.sequence)
        owner, sample, kwargs = cast_loaded(loaded, args.dtype)
        chunks: int = args.chunks or default_chunks(stages, batch or loaded.batch_size)
        entry = cache_entry(loaded, owner, sample, kwargs, args, chunks=chunks, device=device)
        cached = entry.load() if entry is not None else None
        if entry is not None and cached is not None:
            if check_model is not None:
                check_model(len(cached))
            print(f"profile: cached ({entry.path})", file=sys.stderr)
            if index is not None:
                index.store(reads, loaded, chunks, entry)
            return cached, chunks
        model, flat = as_sequential(
            owner,
            sample,
            args.model,
            kwargs=kwargs,
            granularity=args.granularity,
            leaf_modules=args.leaf_modules,
        )
        if check_model is not None:
            check_model(len(model))
        profile = _measure(model, flat, args, chunks, owner, device, plan)
        if entry is not None:
            entry.store(profile)
            if index is not None:
                index.store(reads, loaded, chunks, entry)
        return profile, chunks


def _load_profile(args: argparse.Namespace) -> Profile:
    """The ``--profile`` file, which must have been measured as ``--autocast``/``--dtype`` say."""
    from profiler import Profile

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
    skews = {layer.experts.skew for layer in profile.layers if layer.experts is not None}
    wanted_skew = getattr(args, "expert_skew", None)
    if wanted_skew is not None and skews and skews != {wanted_skew}:
        raise ValueError(
            f"{args.profile} was counted with expert skew {max(skews):g}, not "
            f"--expert-skew {wanted_skew:g}: profile again with it, or leave out --expert-skew"
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


def load_matching(
    args: argparse.Namespace, profile: Profile, profile_path: str, path: str
) -> tuple[nn.Sequential, Sample]:
    """The model file ``path``, cast as the profile was, refused if it has other layers."""
    from autopipe.cli.checks import check_profile_matches
    from profiler import layer_names

    # A profile made with --dtype measured the cast model: compare with that one.
    cast = profile.dtype if profile.dtype in DTYPES and profile.dtype != "float32" else None
    with model_output_to_stderr():
        model, sample = _load(args, cast, path)
    check_profile_matches(profile, model, profile_path, path)
    # A profile saved with slash names (h/3) plans with the names the model gives (h.3).
    for layer, name in zip(profile.layers, layer_names(model), strict=True):
        layer.name = name
    return model, sample


def _measure(
    model: nn.Sequential,
    sample: Sample,
    args: argparse.Namespace,
    chunks: int,
    owner: nn.Module | None = None,
    device: str | None = None,
    plan: dict[str, str] | None = None,
) -> Profile:
    """Profiles ``model``, reporting progress on stderr and failures as one line.

    ``owner`` is the model its layers were traced from, which names shared parameters and
    the modules of the tensor-parallel ``plan`` (the ``--tp-plan`` file's; without it, with
    ``--target``, a Hugging Face model's own).
    """
    from autopipe.graph import shard_styles
    from profiler import MemoryShortage, TerminalProgress, layer_names, profile_model

    counted = getattr(args, "target", None)
    styles = (
        shard_styles(owner or model, list(model.children()), plan)
        if plan is not None or counted
        else None
    )

    children = list(zip(layer_names(model), model.children()))
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
            device=device or args.device or default_device(),
            chunks=chunks,
            warmup=args.warmup,
            repeats=args.repeats,
            progress=progress,
            autocast=args.autocast,
            owner=owner or model,
            # For a catalog device the layers are counted, not timed here.
            measure=not counted,
            shard_styles=styles,
            expert_skew=expert_skew(args),
        )
    except MemoryShortage as exc:
        _end_line(show, done)
        raise ValueError(
            f"{exc.shortage()}; plan for a catalog device with --target DEVICE (the layers "
            "are counted, not run) or make `sample` smaller"
        ) from None
    except ValueError:
        _end_line(show, done)
        raise
    except Exception as exc:
        _end_line(show, done)
        name, child = children[min(done, len(children) - 1)]
        message = " ".join(str(exc).split())
        raise ValueError(
            f"profiling layer {done} ({name}: {type(child).__name__}) failed: "
            f"{type(exc).__name__}: {message}"
        ) from None


def _end_line(show: TerminalProgress, done: int) -> None:
    """Ends an open progress line, so that the error starts a line of its own."""
    if show.enabled() and done:
        show.stream.write("\n")


def _batch_size(sample: Sample) -> int:
    first = sample[0] if isinstance(sample, tuple) else sample
    return int(first.shape[0])
