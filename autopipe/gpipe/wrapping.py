"""``wrap``: any ``nn.Module`` to a balanced GPipe pipeline, through torch.fx or torch.export."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.gpipe.colocated import physical_names
from autopipe.gpipe.gpipe import GPipe
from autopipe.gpipe.wrap_steps import WrapSteps
from autopipe.gpipe.wrapped import WrappedPipeline
from autopipe.graph import (
    FlatSpec,
    has_meta_state,
    model_inputs,
    per_micro_batch_note,
    prepare,
    unit_sequential,
)
from autopipe.microbatching import assemble
from autopipe.planning import PipelineSettings, with_overrides
from profiler import Profile, check_autocast, stage_devices

__all__ = ["prepare", "unit_sequential", "wrap"]

Device = torch.device | str | int


def _device_names(stages: int | None, devices: Sequence[Device] | None) -> list[str]:
    """Each stage's device, named as its physical device, so that the planner sees which
    stages share one (``cpu`` twice; ``cuda`` and ``cuda:0`` when device 0 is current)."""
    if devices is not None:
        if not devices:
            raise ValueError("devices must name at least one device")
        if stages is not None and stages != len(devices):
            raise ValueError(f"stages={stages} but {len(devices)} devices were given")
        return physical_names(devices)
    count = 2 if stages is None else stages
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    return physical_names(stage_devices(count))


def _batch_size(sample: tuple[Any, ...] | Tensor, kwargs: dict[str, Any] | None) -> int:
    """Dim 0 of the first input tensor (tracing checks that all of them agree), else 1."""
    _, tensors = FlatSpec.of(model_inputs(sample, kwargs))
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def wrap(
    model: nn.Module,
    sample: tuple[Any, ...] | Tensor,
    settings: PipelineSettings | None = None,
    *,
    kwargs: dict[str, Any] | None = None,
    stages: int | None = None,
    devices: Sequence[Device] | None = None,
    profile: Profile | None = None,
    **overrides: Any,
) -> WrappedPipeline:
    """Splits any model into balanced pipeline stages and returns it ready to train.

    The model is traced with ``sample`` (torch.fx, or torch.export when fx fails), cut into
    units at module-call boundaries, each unit profiled on the first device, and the units
    balanced over the stages by :func:`autopipe.plan`. A cut sends every tensor live
    across it (skip connections included), and the plan charges exactly those bytes.

    The model's inputs and outputs must be batch-major: every tensor has the batch along
    dim 0 (return per-sample outputs, compute the loss outside). Outputs with a whole
    number of rows per sample (a router's logits per token) come back joined, and a 0-d
    output (a loss or a router's auxiliary loss the model computes) is computed per
    micro-batch and averaged over the samples; some output must have just the batch along
    dim 0. Non-tensor inputs (ints, bools, ``None``) are baked into the graph as constants.
    The model is traced in both training and evaluation mode when they differ (dropout,
    batch norm), so ``train()`` and ``eval()`` work as usual.

    The keywords after ``profile`` are fields of :class:`PipelineSettings`, laid over
    ``settings``; any other is refused (``TypeError``). The pipeline runs GPipe's
    fill-drain schedule, one stage per device and one replica. Stages given the same
    physical device (``["cpu", "cpu"]``) take turns on it, and the plan says so
    (``plan.shared``, priced as ``colocated=True`` prices it).

    Args:
        model: the model; its parameters are moved to their stages' devices in place and
            shared with the returned module.
        sample: the positional inputs of one mini-batch (a tuple, or a single tensor).
        settings: the settings to plan and build under (default: all defaults).
        kwargs: keyword inputs of the sample.
        stages: the number of stages (default: ``len(devices)``, or 2).
        devices: one device per stage (default: the GPUs round-robin, or the CPU for every
            stage; :func:`profiler.devices.stage_devices`).
        profile: a profile of the units to plan with instead of measuring them.
        chunks: micro-batches per mini-batch (default: 4 per stage, each of at least 2
            samples where the batch allows, as ``autopipe plan`` chooses; see
            :func:`autopipe.planning.planner.default_chunks`).
        checkpoint: ``always``, ``except_last`` (default, as for every GPipe schedule:
            :func:`autopipe.planning.pipeline_settings.default_checkpoint`) or ``never``.
        memory: device capacity for the planner (bytes, ``"16GiB"``, or one per device).
        strategy: the planner's strategy (``optimal``, ``uniform``, ...).
        optimizer, bandwidth, overhead: as for :func:`autopipe.plan`.
        granularity: ``children``, ``blocks`` (default) or ``leaves``; see
            :func:`autopipe.graph.units.unit_paths`.
        leaf_modules: submodule names or classes torch.fx treats as opaque calls.
        method: ``auto``, ``fx`` or ``export``.
        autocast: ``bfloat16`` or ``float16`` to profile the units under
            ``torch.autocast``, for a model trained under it (the pipeline itself runs
            under the caller's autocast); a given ``profile`` must have been made so.
        dynamic: the dims besides the batch whose size may vary between calls, by input:
            the name of a keyword input or of a ``forward`` parameter, or a position,
            mapped to a dim, a list of dims, or ``{dim: torch.export.Dim(...)}``, e.g.
            ``{"input_ids": 1, "attention_mask": 1}``. Only torch.export fixes sizes
            (torch.fx keeps them all symbolic): without ``dynamic`` it fixes every dim but
            the batch at the sample's, and each call's inputs are checked against the
            traced shapes and dtypes. Conditions the code branched on are checked on every
            call, so that no call takes another path than the traced one. The units, the
            bytes crossing each cut and the plan are those of the sample.
        deferred_batch_norm: update each BatchNorm's running statistics once per
            mini-batch, from all the inputs it saw, as the plain model does (each
            micro-batch is still normalized with its own statistics). ``None`` (default):
            on when the model has a BatchNorm with running statistics and ``chunks > 1``;
            ``False`` updates them once per micro-batch, with a warning. The model's own
            modules are not converted: the pipeline runs deferred views of them.
        replicate_shared: give each later stage using a shared parameter its own copy even
            on the owner's device (to test the replicated path with one device). By
            default a parameter shared by stages on different devices (a tied embedding
            and LM head) stays with the first of them, and each later stage reads a copy on
            its device, made afresh at every forward; its gradient is the sum of the
            copies', and ``parameters()`` and ``state_dict()`` hold it once.
        init: for a model built on the meta device (all or partly): each stage's meta
            tensors are given storage on that stage's device only (the whole model never
            is on one device), the initializers that exist run on them
            (``reset_parameters``, a Hugging Face model's ``_init_weights``; seeded by
            the stage's index), then ``init(part)``, once per stage. ``part`` is an
            ``nn.Module`` holding exactly that stage's new tensors under the model's names:
            ``part.state_dict()`` has the model's keys of the stage (non-persistent buffers
            aside), so ``part.load_state_dict(checkpoint, strict=False)`` loads the stage
            from a (sharded) checkpoint; submodules all of whose tensors are the stage's
            are the model's own modules in it. A parameter tied across stages is the first
            stage's; a tensor no unit uses goes with its module's other tensors (else to
            the first stage). Without ``init``, a meta tensor that no initializer writes
            is refused (it would train from placeholder values). Only for a model with
            meta tensors.

    Returns:
        A :class:`WrappedPipeline`: call it like the model; ``.plan`` and ``.pipeline``
        are the plan and the GPipe.

    Raises:
        autopipe.graph.tracing.TracingError: the model cannot be traced; the message says why and
            what to do.
        ValueError: bad arguments, inputs or outputs that are not batch-major, too few
            units for the stages, a shared tensor written during forward (a running
            statistic, a counter) that a given profile does not list as tied and the plan
            puts on two devices, or a meta tensor that nothing initializes (without
            ``init``).
        autopipe.PlanningError: no split fits the memory, or none keeps the users of a
            shared tensor written during forward on one stage where stages would copy it
            (on several devices, or with ``replicate_shared``); the planner keeps them
            together whenever a split can.
    """
    settings = with_overrides(settings, overrides, "wrap")
    _check_gpipe(settings)
    chunks = settings.chunks
    bad_chunks = isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    if chunks is not None and bad_chunks:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    names = _device_names(stages, devices)
    # One process: stages on one device take turns on it, and the plan prices them so.
    settings = dataclasses.replace(settings, colocated=True)
    settings = settings.resolved(len(names), _batch_size(sample, kwargs))
    check_autocast(settings.autocast)
    if settings.init is not None and not has_meta_state(model):
        raise ValueError(
            "init= initializes the tensors of a model built on the meta device, but the "
            "model has none on meta; initialize it before wrap(), or build it under "
            'torch.device("meta")'
        )
    autocast = settings.autocast
    if profile is not None and autocast is not None and profile.autocast != autocast:
        raise ValueError(
            f"the profile was made with autocast {profile.autocast or 'none'}, not {autocast}"
        )
    steps = WrapSteps(model, sample, kwargs, names, settings, profile)
    built = assemble(model, settings, steps)
    if built.warning:
        warnings.warn(built.warning, stacklevel=2)
    averaged = built.layers.io.per_micro_batch()
    if averaged and built.plan.chunks > 1:
        warnings.warn(per_micro_batch_note(averaged, built.plan.chunks), stacklevel=2)
    units = nn.Sequential(*built.layers.modules.values())
    pipeline = GPipe.from_plan(units, built.plan, replicate_shared=settings.replicate_shared)
    return WrappedPipeline(model, pipeline, built.plan, built.layers.io)


def _check_gpipe(settings: PipelineSettings) -> None:
    """Refuses settings that GPipe in one process does not run.

    Raises:
        ValueError: another schedule than ``gpipe``, virtual stages, replicas or tensor
            parallelism.
    """
    if settings.schedule not in (None, "gpipe"):
        raise ValueError(
            f"wrap() runs GPipe's schedule, not {settings.schedule!r}; leave out schedule= "
            "or use autopipe.distributed.DistributedPipeline"
        )
    if settings.virtual_stages != 1 or settings.data_parallel not in (None, 1):
        raise ValueError(
            "wrap() runs one pipeline with one stage per device; leave out virtual_stages= "
            "and data_parallel=, or use autopipe.distributed.DistributedPipeline"
        )
    if settings.tensor_parallel != 1:
        raise ValueError(
            "wrap() runs each stage on one device; leave out tensor_parallel=, or use "
            "autopipe.distributed.DistributedPipeline"
        )
