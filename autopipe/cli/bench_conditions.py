"""``autopipe bench``'s profile and calibration, made in the conditions the splits run in.

On local ranks each rank computes on its own share of the CPUs with as many threads
(:func:`autopipe.distributed.cpu_binding.bind_cpus`), beside the other ranks: the model
is profiled on the ranks themselves, all at once, not in one process with every core,
and the runner's own costs (its seconds per stage
and micro-batch, a message between ranks) come from the calibration cache of this
machine and runtime, measured on the ranks the first time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autopipe.cli.inputs import Inputs, read_profile
from autopipe.cli.options import default_device
from autopipe.planning import format_bytes, format_time

if TYPE_CHECKING:
    from autopipe.output import Measured
    from autopipe.planning import Plan
    from profiler import Profile

__all__: list[str] = []  # internal to the command line


def _on_ranks_cpu(args: argparse.Namespace) -> bool:
    return bool(args.ranks) and not (args.device or default_device()).startswith("cuda")


def profile_as_run(
    args: argparse.Namespace,
    stages: int,
    check_model: Callable[[int], None],
    build: Callable[[], Any],
) -> tuple[Inputs, str]:
    """The profile to plan from, and a line saying how it was made.

    With ``--ranks`` the layers are timed on the ranks, every rank profiling at once
    bound as it runs the splits (:mod:`autopipe.distributed.rank_conditions`); this
    process only counts their bytes (one quick run per layer). ``build`` makes the
    model's units and sample on a rank.
    """
    import torch

    from autopipe.cli.bench_options import profile_args

    if args.profile:
        return read_profile(profile_args(args), stages, check_model=check_model), (
            f"profile: {args.profile}"
        )
    runs = f"{args.profile_repeats} timed runs per layer, medians"
    if not args.ranks:
        inputs = read_profile(profile_args(args), stages, check_model=check_model)
        own = _count(torch.get_num_threads(), "thread")
        scaled = ""
        if not args.no_calibrate:
            from profiler import calibrate_in_step

            layers, sample = build()
            chunks = inputs.chunks or args.chunks or inputs.profile.chunks
            found = calibrate_in_step(inputs.profile, layers, sample, chunks=chunks)
            scaled = _scaled(found["fixed_scale"], found["compute_scale"], "in this process")
        return inputs, f"profiled in this process with {own} ({runs}{_spread(inputs)}){scaled}"
    from autopipe.distributed import profile_on_local_ranks, with_rank_times

    quick = argparse.Namespace(**{**vars(args), "profile_repeats": 1, "profile_warmup": 0})
    inputs = read_profile(profile_args(quick), stages, check_model=check_model)
    chunks = inputs.chunks or args.chunks
    try:
        measured = profile_on_local_ranks(
            build,
            args.ranks,
            chunks=chunks or inputs.profile.chunks,
            repeats=args.profile_repeats,
            warmup=args.profile_warmup,
            cuda=not _on_ranks_cpu(args),
            scale=not args.no_calibrate,
        )
    except RuntimeError as exc:
        raise ValueError(f"profiling on the ranks failed: {exc}") from None
    inputs = Inputs(with_rank_times(inputs.profile, measured), inputs.batch, inputs.chunks)
    threads = sorted({found["threads"] for found in measured})
    each = "/".join(str(t) for t in threads)
    bound = ", each bound to its CPUs" if _on_ranks_cpu(args) else ""
    scales = inputs.profile.meta.get("calibration", {})
    scaled = (
        _scaled(scales["fixed_scale"], scales["compute_scale"], "on the ranks at once")
        if "compute_scale" in scales
        else ""
    )
    return inputs, (
        f"profiled on the {args.ranks} ranks at once{bound} with {each} "
        f"thread{'s' if threads != [1] else ''} each ({runs}, the mean over the "
        f"ranks{_spread(inputs)}){scaled}"
    )


def _scaled(fixed: float, per_sample: float, where: str) -> str:
    return (
        f"; in-step scale x{fixed:.2f} per micro-batch, x{per_sample:.2f} per sample (whole "
        f"steps of the model {where} against the profile)"
    )


def _spread(inputs: Inputs) -> str:
    """The profile's spread and cache choice, for the line saying how it was made."""
    meta = inputs.profile.meta
    spread = meta.get("spread")
    text = f"; layer times' spread {spread:.0%}" if isinstance(spread, float) else ""
    cache = meta.get("cache")
    if isinstance(cache, dict) and cache.get("cache_bytes"):
        size, limit = format_bytes(cache["working_set"]), format_bytes(cache["cache_bytes"])
        text += (
            f"; caches flushed before each pass (working set {size} > {limit} cache)"
            if cache["cold"]
            else f"; caches left warm (working set {size} fits the {limit} cache)"
        )
    return text


def calibrate_runner(args: argparse.Namespace, profile: Profile, per_rank: int = 1) -> str:
    """Applies the runner's calibration for ``--ranks`` to ``profile`` (cached, else
    measured on the ranks and cached); the line saying what it applied, or why none.

    ``per_rank`` stages on each rank (interleaved, or a V schedule's 2) run on torch's
    multi-stage runtime, whose cost per operation is its own: it is calibrated apart.
    """
    if not args.ranks:
        return ""
    if args.no_calibrate:
        return "not calibrated (--no-calibrate): the runner's own costs count as free"
    from autopipe.distributed import (
        apply_runner_calibration,
        cache_file,
        cached_runner_calibration,
        calibrate_local_ranks,
        cpu_share,
        runtime_key,
        save_runner_calibration,
    )

    cuda = not _on_ranks_cpu(args)
    if cuda:
        threads, bound, backend = 0, False, "nccl"
    else:
        import os

        threads = len(cpu_share(sorted(os.sched_getaffinity(0)), 0, args.ranks))
        bound, backend = True, "gloo"
    key = runtime_key(
        backend=backend,
        ranks=args.ranks,
        threads=threads,
        bound=bound,
        schedule=args.schedule,
        virtual_stages=per_rank,
    )
    found = None if args.recalibrate else cached_runner_calibration(key)
    if found is None:
        try:
            measured = calibrate_local_ranks(
                args.ranks, schedule=args.schedule, cuda=cuda, virtual_stages=per_rank
            )
        except RuntimeError as exc:
            raise ValueError(f"calibrating the ranks failed: {exc}") from None
        found = save_runner_calibration(key, measured)
        when = f"measured now, kept in {cache_file()}"
    else:
        stamp = found.get("measured_at")
        day = time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp)) if stamp else "earlier"
        when = f"cached from {day} in {cache_file()}"
    apply_runner_calibration(profile, found)
    runtime = f"torch's multi-stage runtime, {args.schedule}: " if per_rank > 1 else ""
    overhead = found.get("virtual_overhead_s", found["overhead_s"]) if per_rank > 1 else None
    return (
        f"calibrated: {runtime}the runner costs "
        f"{format_time(found['overhead_s'] if overhead is None else overhead)} per stage and "
        f"micro-batch, a message {format_time(found.get('latency_s', 0.0))} + "
        f"{format_bytes(found.get('bandwidth', 0.0))}/s ({when})"
    )


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def fit_in_place(
    profile: Profile,
    plans: dict[str, Plan],
    measured: dict[str, Measured],
    devices: int | list[str],
    options: dict[str, Any],
    source: str = "in-place figures",
) -> tuple[Profile, str]:
    """The profile refined on the splits' warm-up steps timed where they ran, and the line
    saying how (``predicted from {source}: ...``).

    On ranks every stage's forward and backward were timed in the pipeline
    (:func:`autopipe.planning.model.in_place_fit.fit_layer_scales`); in one process the
    stages share the device, so each split's whole step gives one factor for every layer,
    the least-squares fit of the predicted steps to the measured ones.
    """
    from autopipe.planning import (
        StageSeconds,
        evaluate,
        fit_layer_scales,
        fit_update,
        scaled_profile,
        stage_param_bytes,
        uniform_scales,
    )

    timed = {label: found.in_place for label, found in measured.items() if found.in_place}
    if not timed:
        return profile, ""
    missed = [
        label
        for label, figures in timed.items()
        if figures["stages"] and not _every_stage(plans[label], figures["stages"])
    ]
    if missed:
        # A schedule whose actions the recorder does not see whole (a stage without a
        # forward or a backward timed) would fit factors on part of the work: predict
        # from the profile instead, and say so.
        return profile, (
            f"predicted from the profile: the warm-up steps' recorder did not time every "
            f"stage's forward and backward of {', '.join(missed)}"
        )
    # The optimizer's step, timed apart on every rank (or in the process).
    pairs = []
    for label, figures in timed.items():
        if figures["stages"]:
            for stage, found in zip(plans[label].stages, figures["stages"], strict=True):
                pairs.append((stage_param_bytes(profile, stage.start, stage.stop), found["update"]))
        else:
            pairs.append((stage_param_bytes(profile, 0, len(profile)), figures["update"]))
    update = fit_update(pairs)
    on_ranks = all(figures["stages"] for figures in timed.values())
    if on_ranks:
        observed = [
            StageSeconds(
                plans[label],
                [stage["forward"] for stage in figures["stages"]],
                [stage["backward"] for stage in figures["stages"]],
            )
            for label, figures in timed.items()
        ]
        scales = fit_layer_scales(profile, observed)
        how = "each stage's forward and backward timed on its rank in the later warm-up steps"
        if options.get("virtual_stages", 1) > 1:
            how += " (a rank's stages apart"
            # Zero bubble's backward runs in two halves, the input's and the weights'.
            split = options.get("schedule") in ("zb", "zbv", "dualpipev")
            how += ", a backward its input and weight parts together)" if split else ")"
    else:
        # The step is linear in a factor g on every layer's time as long as the bottleneck
        # does not move: step(g) = p1 + (p2 - p1)(g - 1), with p2 the step at g = 2.
        once = scaled_profile(profile, uniform_scales(profile, 1.0), "", update)
        doubled = scaled_profile(profile, uniform_scales(profile, 2.0), "", update)
        num = den = 0.0
        for label, figures in timed.items():
            p1 = evaluate(once, plans[label].balance, devices, strategy=label, **options).step_time
            p2 = evaluate(
                doubled, plans[label].balance, devices, strategy=label, **options
            ).step_time
            slope, seen = p2 - p1, figures["step"]
            num, den = num + (seen - p1) * slope / seen**2, den + slope**2 / seen**2
        factor = 1.0 + num / den if den > 0 else 1.0
        scales = uniform_scales(profile, max(factor, 0.05))
        how = (
            f"every layer's time x{max(factor, 0.05):.2f}, fitted on the splits' later warm-up "
            "steps, taken in turn with the timed ones"
        )
    fitted = scaled_profile(profile, scales, how, update)
    mib = format_time(update * 2**20)
    line = f"predicted from {source}: {how}; the optimizer's step {mib}/MiB"
    if on_ranks:
        # What the stages' figures leave out of a step is the runner's own cost per step
        # (the inputs' split, the ranks' agreement, the schedule's setup and last waits):
        # the median over the splits' unrecorded warm-up steps of each less its prediction
        # (a median: now and then a step of a shared host takes twice as long).
        left = []
        for label, figures in timed.items():
            predicted = evaluate(
                fitted, plans[label].balance, devices, strategy=label, **options
            ).step_time
            left += [seen - predicted for seen in figures.get("steps", [figures["step"]])]
        fixed = max(statistics.median(left), 0.0)
        fitted.meta["calibration"]["step_overhead_s"] = fixed
        line += f", the runner {format_time(fixed)} per step"
    return fitted, line


def _every_stage(plan: Plan, stages: list[dict[str, float]]) -> bool:
    """Whether the recorded ``stages`` hold a forward and a backward of every stage of
    ``plan`` (several per rank included), each of some time."""
    return len(stages) == plan.num_stages and all(
        found.get("forward", 0.0) > 0 and found.get("backward", 0.0) > 0 for found in stages
    )


def replan(
    profile: Profile,
    plans: dict[str, Plan],
    devices: int | list[str],
    options: dict[str, Any],
    optimal: bool = True,
) -> dict[str, Plan]:
    """Every split predicted again from ``profile``: ``optimal`` planned afresh (it may
    choose another split) unless not ``optimal``, the other strategies' and the given
    splits kept as they were (the strategies split by their own rules, not by these
    figures)."""
    from autopipe.planning import evaluate, plan

    out = {}
    for label, found in plans.items():
        if label == "optimal" and optimal:
            out[label] = plan(profile, devices, strategy="optimal", **options)
        else:
            out[label] = evaluate(profile, found.balance, devices, strategy=label, **options)
    return out
