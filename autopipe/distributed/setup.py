"""What a distributed pipeline does before its stages exist: checks, agreement, planning."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed import cpu_binding
from autopipe.distributed.calibration_cache import (
    apply_runner_calibration,
    cached_runner_calibration,
    current_runtime_key,
)
from autopipe.distributed.collectives import collective
from autopipe.distributed.padding import rows_mixing_layer
from autopipe.distributed.prepared import Prepared
from autopipe.distributed.stage import compare_fingerprints, layer_output_specs
from autopipe.distributed.tied_gradients import shared_state, written_shared
from autopipe.distributed.v_stages import V_SCHEDULES, is_v_schedule
from autopipe.distributed.virtual import check_virtual
from autopipe.graph import shard_styles
from autopipe.planning import ALL_SCHEDULES, PipelineSettings, Plan, keep_together, with_overrides
from autopipe.planning import plan as make_plan
from profiler import Profile, profile_model

__all__: list[str] = []

DEFAULT_TIMEOUT = timedelta(minutes=5)


def init_distributed(
    backend: str | None = None,
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    bind_cpus: bool = False,
    **kwargs: Any,
) -> torch.device:
    """Initialises the default process group from torchrun's environment; returns the device.

    Picks ``nccl`` with ``cuda:LOCAL_RANK`` when CUDA is available, else ``gloo`` on the CPU.
    ``timeout`` bounds every wait on another rank: when a rank fails or hangs, the others
    raise after at most this long instead of waiting forever (a rank whose process exits is
    noticed at once). Does nothing but return the device if a group already exists.

    Args:
        backend: ``gloo``, ``nccl``, ... (default: by device, as above).
        timeout: the process group's timeout.
        bind_cpus: for CPU ranks, bind this process to its own share of the host's CPUs
            (and as many torch threads) before the group starts, see
            :mod:`autopipe.distributed.cpu_binding`; the ranks on the host come from torchrun's
            ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` (or ``rank``/``world_size`` below).
        **kwargs: passed on to ``torch.distributed.init_process_group`` (``init_method``,
            ``rank``, ``world_size``, ...).
    """
    cuda = torch.cuda.is_available() if backend is None else "nccl" in backend
    device = torch.device("cpu")
    if cuda:
        # Local rank k on GPU k, as profiler.devices.stage_devices places stage k, but not
        # round-robin: NCCL refuses two ranks on one GPU, and set_device names the cause.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return device
    if bind_cpus and not cuda:
        cpu_binding.bind_cpus(
            *cpu_binding.local_rank_and_size(kwargs.get("rank"), kwargs.get("world_size"))
        )
    dist.init_process_group(backend or ("nccl" if cuda else "gloo"), timeout=timeout, **kwargs)
    return device


def agree(rank: int, world: int, problem: str | None, fingerprint: Mapping[str, Any]) -> None:
    """Exchanges every rank's argument problem and fingerprint; a collective.

    Raises:
        ValueError: some rank has a problem, or the fingerprints differ (on every rank).
    """
    everyone: list[Any] = [None] * world
    mine = (problem, fingerprint)
    collective(rank, "compare the ranks' arguments", dist.all_gather_object, everyone, mine)
    for other, (error, _) in enumerate(everyone):
        if error:
            raise ValueError(error if other == rank else f"rank {other}: {error}")
    difference = compare_fingerprints([print_ for _, print_ in everyone])
    if difference:
        raise ValueError(f"the ranks were given different configurations: {difference}")


def agree_on_step(
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    step: int,
    problem: str | None,
) -> None:
    """Every rank's verdict on its part of a step, exchanged before the step sends anything.

    A collective: one all-reduce of three integers (whether this rank's arguments are
    invalid, and its step count as a maximum and a minimum), and only when some rank
    found a problem, a gather of the messages. A step refused on one rank is so refused
    on every rank, and the pipeline stays usable; without it the other ranks would run
    the step and pair its messages with the next one's.

    Raises:
        ValueError: some rank's part of the step is invalid (on every rank, with that
            rank's message).
        RuntimeError: the ranks have run different numbers of steps, or another rank
            failed (after the process group's timeout).
    """
    on = device if device.type == "cuda" else torch.device("cpu")
    flags = torch.tensor([problem is not None, step, -step], dtype=torch.int64, device=on)
    what = "agree on the step with the other ranks"
    collective(rank, what, dist.all_reduce, flags, op=dist.ReduceOp.MAX, group=group)
    failed, latest, earliest = (int(v) for v in flags.tolist())
    earliest = -earliest
    if latest != earliest:
        raise RuntimeError(
            f"the ranks are out of step: this rank has run {step} steps, another "
            f"{earliest if step == latest else latest}; call step() on every rank alike"
        )
    if not failed:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    what = "share the step's problems"
    collective(rank, what, dist.all_gather_object, everyone, problem, group=group)
    for other, error in enumerate(everyone):
        if error:
            raise ValueError(error if other == rank else f"rank {other}: {error}")


def check_like_sample(tensors: tuple[Tensor, ...], sample: Any, what: str) -> None:
    """Checks that a step's tensors have the sample's shapes past dim 0 and its dtypes.

    The stages' buffers were measured on the sample, so anything else would fail on one
    rank mid-step (the others waiting) or exchange tensors of the wrong size.

    Raises:
        ValueError: another count, shape or dtype.
    """
    expected = (sample,) if isinstance(sample, Tensor) else tuple(sample)
    if len(tensors) != len(expected):
        count = len(expected)
        raise ValueError(f"{what} must be {count} tensors, as the sample; got {len(tensors)}")
    for index, (tensor, like) in enumerate(zip(tensors, expected, strict=True)):
        if tensor.shape[1:] != like.shape[1:] or tensor.dtype != like.dtype:
            name = what if len(expected) == 1 else f"{what}[{index}]"
            want = ("N", *like.shape[1:])
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype} but the "
                f"pipeline was built for shape ({', '.join(map(str, want))}) and dtype "
                f"{like.dtype}, the sample's; give every step inputs shaped as the sample, "
                "or build the pipeline with such a sample"
            )


def batch_tensors(value: Any, batch: int, device: torch.device, what: str) -> tuple[Tensor, ...]:
    """``value`` as a tuple of tensors on ``device``, checked to have ``batch`` rows.

    Raises:
        ValueError: not tensors, another batch size, or tensors on the meta device.
    """
    tensors = (value,) if isinstance(value, Tensor) else tuple(value or ())
    if not tensors or not all(isinstance(t, Tensor) for t in tensors):
        raise ValueError(f"this stage needs {what}: a tensor or a tuple of tensors")
    if any(t.dim() == 0 or t.shape[0] != batch for t in tensors):
        sizes = [tuple(t.shape) for t in tensors]
        raise ValueError(f"{what} must have batch size {batch} (as the sample); got {sizes}")
    if any(t.is_meta for t in tensors):  # moving one would fail with torch's own error
        raise ValueError(
            f"{what} must hold values, not be on the meta device: pass tensors with data "
            f"(on any device; the pipeline moves them to {device})"
        )
    return tuple(t.to(device) for t in tensors)


def _batch_problem(sample: Any, chunks: int, layers: Mapping[str, nn.Module]) -> str | None:
    tensors = (sample,) if isinstance(sample, Tensor) else sample
    if not isinstance(tensors, (tuple, list)) or not tensors:
        return (
            f"sample must be a tensor or a non-empty tuple of tensors, got {type(sample).__name__}"
        )
    if not all(isinstance(t, Tensor) and t.dim() > 0 for t in tensors):
        return "sample must hold tensors with a batch dimension (dim 0)"
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) > 1:
        return f"sample tensors disagree on the batch size (dim 0): {sorted(sizes)}"
    batch = sizes.pop()
    if batch < chunks:
        return f"the batch size {batch} is smaller than chunks={chunks}; use at most {batch}"
    mixing = rows_mixing_layer(layers.items()) if batch % chunks else None
    if mixing:
        # Padded micro-batches would change its batch statistics.
        return (
            f"the batch size {batch} is not a multiple of chunks={chunks} and layer {mixing!r} "
            "has BatchNorm, whose batch statistics would include padding rows; use a batch "
            "size that is a multiple of chunks"
        )
    return None


def check_arguments(
    layers: Mapping[str, nn.Module],
    sample: Any,
    chunks: Any,
    schedule: Any,
    loss_fn: Any,
    plan: Any,
) -> str | None:
    """What is wrong with one rank's arguments, or ``None``."""
    if schedule not in ALL_SCHEDULES and not is_v_schedule(schedule):
        known = (*ALL_SCHEDULES, *(name for name in V_SCHEDULES if name not in ALL_SCHEDULES))
        return f"unknown schedule {schedule!r}: choose one of {', '.join(known)}"
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        return f"chunks must be a positive integer, got {chunks!r}"
    if not callable(loss_fn):
        return "loss_fn must be callable as loss_fn(output, target)"
    if plan is not None and not isinstance(plan, Plan):
        return f"plan must be an autopipe Plan, got {type(plan).__name__}"
    if not layers:
        return "the model has no layers"
    if len({id(layer) for layer in layers.values()}) != len(layers):
        return "the model holds the same layer more than once; that is not supported"
    return _batch_problem(sample, chunks, layers)


def fingerprint_settings(
    sample: Any, chunks: int, schedule: str, plan: Plan | None, profile: Any
) -> dict[str, Any]:
    """The arguments besides the model that every rank must agree on."""
    tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
    return {
        "chunks": chunks,
        "schedule": schedule,
        "sample": [(tuple(t.shape), str(t.dtype)) for t in tensors],
        "plan": None if plan is None else list(plan.balance),
        "profile given": profile is not None,
    }


def check_sizes(
    num_stages: int,
    layers: int,
    plan: Plan | None,
    schedule: str,
    chunks: int,
    *,
    data_parallel: int = 1,
    virtual_stages: int = 1,
) -> None:
    """Checks that the stages (K), replicas (D), virtual stages (v), layers, plan and
    schedule fit together; ``num_stages`` is K, the ranks of one pipeline.

    Raises:
        ValueError: they do not (the same on every rank, as the arguments agree).
    """
    k, d, v = num_stages, data_parallel, virtual_stages
    if plan is not None and plan.virtual_stages not in (1, v):
        raise ValueError(
            f"the plan was made for virtual_stages={plan.virtual_stages} but the pipeline runs "
            f"virtual_stages={v}; pass virtual_stages={plan.virtual_stages} or re-plan"
        )
    if plan is not None and plan.num_stages != k * v:
        if v > 1:
            raise ValueError(
                f"the plan has {plan.num_stages} stages but virtual_stages={v} on {k} ranks "
                f"per pipeline runs K·v = {k * v}; re-plan for {k * v} stages"
            )
        if d == 1:
            raise ValueError(
                f"the plan has {plan.num_stages} stages but the process group has {k} ranks; "
                f"launch {plan.num_stages} processes (one stage per rank) or re-plan for {k}"
            )
        raise ValueError(
            f"the plan has {plan.num_stages} stages but the process group has {k * d} ranks "
            f"= {d} replicas of {k} stages; launch {plan.num_stages * d} processes or re-plan "
            f"for {k}"
        )
    if plan is not None and sum(plan.balance) != layers:
        raise ValueError(f"the plan splits {sum(plan.balance)} layers; the model has {layers}")
    if is_v_schedule(schedule):  # checked whole by v_stages.check_v_sizes
        return
    if layers < k * v:
        per = "one per rank" if v == 1 else f"{v} per rank"
        raise ValueError(f"cannot split {layers} layers into {k * v} stages ({per})")
    if v > 1 or schedule == "zb":
        check_virtual(k, v, schedule, chunks)
    elif schedule == "1f1b" and chunks < k:
        per = "ranks" if d == 1 else "stages"
        raise ValueError(
            f"1f1b needs chunks >= the number of stages; got chunks={chunks} for {k} {per} "
            "(use more chunks or schedule='gpipe')"
        )


def _with_cached_calibration(
    profile: Profile,
    ranks: int,
    settings: PipelineSettings,
    measured: Mapping[str, float] | None = None,
) -> Profile:
    """A profile without a calibration of the runner, with the runner's figures just
    ``measured`` or else this machine's cached ones for the runtime the pipeline runs on
    (:mod:`autopipe.distributed.calibration_cache`), so the plan counts the runner's own
    costs; as it is without either. The caller's profile is left unchanged."""
    found = profile.meta.get("calibration")
    if isinstance(found, dict) and "overhead_s" in found:  # calibrated for this run
        return profile
    key = current_runtime_key(ranks, str(settings.schedule or "1f1b"), settings.virtual_stages)
    cached = measured if measured is not None else cached_runner_calibration(key)
    if cached is None:
        return profile
    calibrated = copy.copy(profile)
    calibrated.meta = dict(profile.meta)
    apply_runner_calibration(calibrated, cached)
    return calibrated


def rank0_profile(
    sequential: nn.Sequential,
    sample: Tensor | tuple[Tensor, ...],
    device: torch.device,
    profile: Profile | Mapping[str, Any] | None,
    settings: PipelineSettings,
    owner: nn.Module | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> Profile:
    """The profile rank 0 plans from: the given one, checked, or the layers measured on
    ``device`` under ``settings.autocast``, ``settings.chunks`` micro-batches of ``sample``
    (one pipeline's mini-batch). With ``settings.tensor_parallel`` > 1 the measured layers
    are counted with their shards under ``tp_plan`` (default: the model's own), which the
    plan prices the tensor-parallel stages from.

    Raises:
        ValueError: the profile does not fit the model or the autocast.
    """
    autocast = settings.autocast
    if profile is None:
        named = owner if owner is not None else sequential
        styles = None
        if settings.tensor_parallel > 1:
            styles = shard_styles(named, list(sequential), tp_plan)
        # The sample is the first layer's one argument: a tensor, or a tuple.
        return profile_model(
            sequential,
            (sample,),
            device=device,
            chunks=settings.chunks,
            autocast=autocast,
            owner=named,
            shard_styles=styles,
        )
    if not isinstance(profile, Profile):
        profile = Profile.from_dict(dict(profile))
    if autocast is not None and profile.autocast != autocast:
        raise ValueError(
            f"the profile was made with autocast {profile.autocast or 'none'}, not {autocast}"
        )
    if len(profile.layers) != len(sequential):
        raise ValueError(
            f"the profile has {len(profile.layers)} layers but the model has {len(sequential)}"
        )
    return profile


def rank0_plan(
    profile: Profile,
    num_stages: int,
    ranks: int,
    settings: PipelineSettings,
    unsplit: Collection[str] = (),
    *,
    measured: Mapping[str, float] | None = None,
) -> Plan:
    """Rank 0's plan of ``num_stages`` stages (K, or K·v) on ``ranks`` ranks per pipeline,
    with this machine's cached calibration of the runner where the profile has none.

    ``unsplit`` names the shared tensors whose users must stay on one stage (buffers each
    rank would copy while some layer writes them, :func:`written_shared`): the planner
    makes no cut between them (:func:`autopipe.planning.model.cut_rules.keep_together`).
    ``measured``: the runner's figures the ranks just measured (``calibrate=True``), used
    before the cache.

    Raises:
        ValueError: no plan fits.
    """
    calibrated = _with_cached_calibration(profile, ranks, settings, measured)
    return make_plan(keep_together(calibrated, unsplit), num_stages, settings)


def check_given_plan(plan: Plan, chunks: int, schedule: str) -> None:
    """Warns when a given plan was made for other micro-batches or another schedule."""
    if plan.chunks != chunks or plan.schedule != schedule:
        warnings.warn(
            f"the plan was made for chunks={plan.chunks}, schedule={plan.schedule!r} "
            f"but runs with chunks={chunks}, schedule={schedule!r}; its predicted "
            "costs do not apply",
            stacklevel=4,
        )


def boundary_specs(
    sequential: nn.Sequential,
    sample: Tensor | tuple[Tensor, ...],
    chunks: int,
    autocast: str | None,
) -> list[Any]:
    """The specs of the tensors leaving every layer, for one micro-batch of ``sample``."""
    tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
    micro = tuple(t.tensor_split(chunks)[0] for t in tensors)
    first = micro[0] if isinstance(sample, Tensor) else micro
    return layer_output_specs(list(sequential), first, autocast)


def setup_on_rank0(
    prepared: Prepared,
    sample: Tensor | tuple[Tensor, ...],
    num_stages: int,
    device: torch.device,
    plan: Plan | None,
    profile: Profile | Mapping[str, Any] | None,
    settings: PipelineSettings,
    ranks: int | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> tuple[Plan, list[Any]]:
    """Profiles (if needed), plans (if needed) and measures the boundary tensors, as the
    runner's build path does on rank 0 (:func:`rank0_profile`, :func:`rank0_plan`,
    :func:`boundary_specs`).

    Args:
        prepared: the model made ready for stages: its layers, the buffers some layer may
            write (:attr:`Prepared.written`) and the model whose names the profile gives
            tied tensors (:attr:`Prepared.owner`).
        sample: one mini-batch of one pipeline (a replica's shard when there are several),
            as ``prepared.sequential`` takes it.
        num_stages: the number of stages to plan (K, or K·v with virtual stages).
        device: where to profile.
        plan: the given plan, or ``None`` to plan.
        profile: the given profile, or ``None`` to profile the model on ``device``.
        settings: what to plan under, ``chunks`` and ``schedule`` given; its ``autocast``
            is the one the pipeline runs under.
        ranks: the ranks of one pipeline (K; default ``num_stages``).
        tp_plan: the tensor-parallel plan the profile counts shards under with
            ``settings.tensor_parallel`` > 1 (default: the model's own).

    Returns:
        The plan and the specs of the tensors leaving every layer, for one micro-batch.

    Raises:
        ValueError: ``chunks`` or ``schedule`` is not given, the profile does not fit the
            model or the autocast, no plan fits, or the plan puts the users of a buffer
            that may be written on two ranks.
    """
    settings = with_overrides(settings, {}, "setup_on_rank0")  # refuses another type
    chunks, schedule = settings.chunks, settings.schedule
    if chunks is None or schedule is None:
        raise ValueError("setup_on_rank0 plans for given micro-batches: set chunks and schedule")
    settings = settings.resolved(distributed=True)
    sequential, written, owner = prepared.sequential, prepared.written, prepared.owner
    if plan is None:
        found = rank0_profile(sequential, sample, device, profile, settings, owner, tp_plan)
        named = owner if owner is not None else sequential
        unsplit = written_shared(list(sequential), written, named)
        plan = rank0_plan(found, num_stages, ranks or num_stages, settings, unsplit)
    else:
        check_given_plan(plan, chunks, schedule)
    plan.check_runnable("DistributedPipeline")
    shared = shared_state(list(sequential), plan.balance, ranks, written)
    if shared:
        raise ValueError(shared)
    return plan, boundary_specs(sequential, sample, chunks, settings.autocast)
