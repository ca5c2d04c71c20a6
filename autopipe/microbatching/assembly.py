"""The one build path of both runners: trace, defer batch norm, profile, plan, place, materialize.

:func:`assemble` runs these steps in this order for :func:`autopipe.wrap` (GPipe in one
process) and for :class:`autopipe.distributed.DistributedPipeline` (a stage per rank)
alike, and returns one :class:`Assembly` that the runner only turns into its stages.
What differs between the runners is each step's own work, given by :class:`BuildSteps`:
how the model becomes layers, where the profile and the plan are made (on the one
process, or on rank 0 and broadcast), and which stages this process materializes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from autopipe.graph import has_meta_state, materialize_units, meta_bytes, rebind_state, unused_meta
from autopipe.microbatching.batchnorm import resolve_deferred
from autopipe.microbatching.batchnorm_units import defer_layers
from autopipe.microbatching.buffer_snapshot import per_micro_batch_writes
from autopipe.planning import PipelineSettings, Plan
from profiler import Profile, format_bytes, physical_device, storage_shortage

__all__ = ["Assembly", "Layers", "assemble"]


@dataclass
class Layers:
    """The model as the layers a pipeline splits, as :meth:`BuildSteps.layers` makes them.

    Attributes:
        modules: the layers in order, by the names their stages register them under.
        io: how the model's inputs and outputs map to the layers' (the runner's own kind).
        shared: the tensors several layers use, as the tracer found them (empty when the
            model was not traced).
        written: the tensors some layer may write in place (names or ``id``, as the
            runner's placement check takes them; ``None``: any buffer may be).
        originals: the layers before deferred batch norm replaced any (their tensors are
            rebound to the model's after materializing).
    """

    modules: OrderedDict[str, nn.Module]
    io: Any = None
    shared: list[Any] = field(default_factory=list)
    written: Any = None
    originals: list[nn.Module] = field(default_factory=list)


@dataclass
class Assembly:
    """What a runner builds its stages from; every step of :func:`assemble` done.

    Attributes:
        layers: the layers (deferred views where batch norm is deferred), their I/O and
            their shared tensors.
        plan: the plan (made here, on rank 0, or given).
        stage_devices: the device of each stage this process holds, by stage index.
        deferred: whether batch-norm statistics are deferred to once per step.
        warning: what to warn the caller of (``deferred_batch_norm=False`` on a model
            with running statistics), or ``None``.
    """

    layers: Layers
    plan: Plan
    stage_devices: dict[int, str | torch.device]
    deferred: bool
    warning: str | None = None


class BuildSteps(Protocol):
    """Each runner's part of the steps :func:`assemble` runs, in the order listed.

    Attributes:
        given: the plan the caller gave, used instead of profiling and planning.
    """

    given: Plan | None

    def layers(self) -> Layers:
        """The model as layers, its arguments checked.

        Raises:
            ValueError: the model or an argument is invalid.
        """
        ...

    def agree(self, layers: Layers | None, deferred: bool, error: Exception | None) -> None:
        """Settles the arguments before anything is measured; raises ``error`` if any
        (a distributed runner first tells every rank and compares their arguments)."""
        ...

    def plan(self, layers: Layers, make: Callable[[], Plan]) -> Plan:
        """The plan ``make()`` makes (profile, plan, check placement): here, or on rank 0
        and received from it."""
        ...

    def profile(self, layers: Layers) -> Profile:
        """The given profile (checked against the layers), else one measured now."""
        ...

    def make_plan(self, layers: Layers, profile: Profile) -> Plan:
        """The plan of ``profile``'s layers for this runner's devices."""
        ...

    def check_placement(self, layers: Layers, plan: Plan) -> None:
        """Refuses a plan that puts a tensor written in place on two devices (``ValueError``)."""
        ...

    def stage_devices(self, plan: Plan) -> dict[int, str | torch.device]:
        """The stages this process holds, each with its device."""
        ...

    def materialized(self, error: ValueError | None) -> None:
        """Settles whether every process could initialize its stages; raises ``error``."""
        ...


def materialize_stages(
    model: nn.Module,
    layers: Sequence[nn.Module],
    balance: Sequence[int],
    devices: dict[int, str | torch.device],
    init: Callable[[nn.Module], None] | None,
    originals: Sequence[nn.Module] = (),
    names: Sequence[str] = (),
) -> None:
    """Gives the meta tensors of the stages in ``devices`` storage on each one's device and
    initializes them (see :func:`autopipe.graph.meta.materialize_units`); the other stages'
    stay on meta.

    Each stage is materialized on its own, seeded by its index, ``init(part)`` called once
    per stage; a tensor two of these stages use is the first one's. Afterwards every
    layer's graphs (and ``originals``') read the model's current tensors, so that tensors
    several stages use are still found by identity.

    Raises:
        ValueError: a tensor that nothing initializes (without ``init``), see
            :func:`autopipe.graph.meta.materialize_units`; a stage whose tensors do not fit
            its device's free memory (:func:`check_stage_memory`), before any is
            materialized.
    """
    starts = [sum(balance[:s]) for s in range(len(balance))]
    stages = [list(layers[start : start + size]) for start, size in zip(starts, balance)]
    extra = unused_meta(model, stages)
    labels = [
        _label(stage, list(names[start : start + len(stage)]))
        for start, stage in zip(starts, stages)
    ]
    check_stage_memory(model, stages, extra, devices, labels)
    for k in sorted(devices):
        materialize_units(model, stages[k], devices[k], init, seed=k, extra=extra[k])
    for layer in (*layers, *originals):
        rebind_state(layer, model)


def _label(stage: Sequence[nn.Module], names: Sequence[str]) -> str:
    """A stage's layers in words: ``layers h.0..h.3``, or their classes without names."""
    shown = list(names) or [type(layer).__name__ for layer in stage]
    return f"layer {shown[0]}" if len(shown) == 1 else f"layers {shown[0]}..{shown[-1]}"


def check_stage_memory(
    model: nn.Module,
    stages: Sequence[Sequence[nn.Module]],
    extra: Sequence[Sequence[str]],
    devices: dict[int, str | torch.device],
    labels: Sequence[str] = (),
) -> None:
    """Refuses to materialize stages whose meta tensors do not fit their devices' free
    memory, before any is given storage: a stage too large would push the host into swap
    or the out-of-memory killer (or fail inside the CUDA allocator) half-way through.

    Each stage in ``devices`` is checked with the stages before it on the same device (all
    of them are materialized before training starts), against
    :func:`profiler.memory_guard.storage_shortage`.

    Raises:
        ValueError: the first stage that does not fit: its index, layers, bytes and device.
    """
    order = sorted(devices)
    sizes = meta_bytes(model, [stages[k] for k in order], [extra[k] for k in order])
    held: dict[str, int] = {}
    for k, size in zip(order, sizes, strict=True):
        device = str(physical_device(devices[k]))
        before = held.get(device, 0)
        held[device] = before + size
        problem = storage_shortage(held[device], device)
        if problem is None:
            continue
        label = labels[k] if labels else _label(stages[k], [])
        with_earlier = f", with {format_bytes(before)} of earlier stages there," if before else ""
        raise ValueError(
            f"materializing stage {k} ({label}) on {device} "
            f"for its {format_bytes(size)} of parameters and buffers{with_earlier} {problem}; "
            "free memory there, give the stages more devices (or more stages on more "
            "devices) so each holds less, or load a smaller model"
        )


def assemble(model: nn.Module, settings: PipelineSettings, steps: BuildSteps) -> Assembly:
    """Runs the build path: layers, deferred batch norm, agreement, profile, plan,
    placement check, meta materialization; ``settings`` are resolved.

    Raises:
        ValueError: what the steps refuse; any other error of a step as raised.
    """
    error: Exception | None = None
    layers: Layers | None = None
    deferred, warning = False, None
    try:
        layers = steps.layers()
        replicas = settings.data_parallel or 1
        deferred, warning = resolve_deferred(
            settings.deferred_batch_norm, model, int(settings.chunks or 1), replicas
        )
        if deferred:  # the stages run these; the model is left as it is
            layers.originals = list(layers.modules.values())
            layers.modules = defer_layers(layers.modules, model)
    except ValueError as exc:
        error = exc
    steps.agree(layers, deferred, error)
    assert layers is not None  # agree raised otherwise
    found = layers

    def make() -> Plan:
        made = steps.given
        if made is None:
            made = steps.make_plan(found, steps.profile(found))
        steps.check_placement(found, made)
        return made

    plan = steps.plan(layers, make)
    written = per_micro_batch_writes(model, layers.modules.values())
    if written and plan.chunks > 1:
        # Nothing a pipeline can do keeps them whole-batch: say so rather than differ.
        note = (
            f"the model's forward writes the buffers {', '.join(written)} in place: each of "
            f"the {plan.chunks} micro-batches writes them (and reads what the micro-batches "
            "before it wrote), where the plain model writes them once per batch; chunks=1 "
            "gives the plain model's"
        )
        warning = f"{warning}; {note}" if warning else note
    devices = steps.stage_devices(plan)
    if has_meta_state(model):  # these stages only: no process holds the whole model
        problem: ValueError | None = None
        try:
            materialize_stages(
                model,
                list(layers.modules.values()),
                plan.balance,
                devices,
                settings.init,
                layers.originals,
                list(layers.modules),
            )
        except ValueError as exc:
            problem = exc
        steps.materialized(problem)
    return Assembly(layers, plan, devices, deferred, warning)
