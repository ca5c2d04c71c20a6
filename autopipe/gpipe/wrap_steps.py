"""``wrap``'s part of the build path: a traced model's units, profiled and planned here."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.graph import (
    GRANULARITIES,
    Layout,
    SequentialModel,
    check_placement,
    copied_written,
    layout_model,
    prepare,
    stage_of_units,
)
from autopipe.microbatching import Layers
from autopipe.planning import PipelineSettings, Plan, keep_together
from autopipe.planning import plan as make_plan
from profiler import Profile, default_batch_sizes, profile_layers, smallest_batch

__all__: list[str] = []


def too_few(model: nn.Module, layout: Layout, granularity: str, stages: int) -> str:
    """Why the model has fewer units than stages, and the ways out that exist."""
    count = len(layout.names)
    text = (
        f"the model has {count} unit{'s' if count != 1 else ''} at granularity "
        f"{granularity!r} ({', '.join(layout.names)}), too few for {stages} stages; "
        f"use at most {count} stage{'s' if count != 1 else ''}"
    )
    # Advise another granularity only where it gives enough units on this very trace.
    others: dict[str, int] = {}
    for other in GRANULARITIES:
        if other != granularity:
            with contextlib.suppress(ValueError):
                others[other] = len(layout_model(model, layout.traced, other).names)
    fits = [g for g, n in others.items() if n >= stages]
    if fits:
        best = max(fits, key=others.__getitem__)
        return f"{text} or granularity={best!r} ({others[best]} units)"
    if layout.merged:
        return f"{text}; boundaries that cannot be cut were merged ({layout.merged[0]})"
    return text


class WrapSteps:
    """:func:`wrap`'s part of the build path (:func:`autopipe.microbatching.assembly.assemble`):
    everything on this process, the plan made for ``names``."""

    def __init__(
        self,
        model: nn.Module,
        sample: tuple[Any, ...] | Tensor,
        kwargs: dict[str, Any] | None,
        names: list[str],
        settings: PipelineSettings,
        profile: Profile | None,
    ) -> None:
        self.model, self.sample, self.kwargs = model, sample, kwargs
        self.names, self.settings, self.given_profile = names, settings, profile
        self.given: Plan | None = None
        self.model_units: SequentialModel | None = None

    def layers(self) -> Layers:
        settings = self.settings
        layout = prepare(
            self.model,
            self.sample,
            kwargs=self.kwargs,
            granularity=settings.granularity,
            leaf_modules=settings.leaf_modules,
            method=settings.method,
            dynamic=settings.dynamic,
        )
        units = SequentialModel.of(layout)
        if len(units.units) < len(self.names):
            raise ValueError(too_few(self.model, layout, settings.granularity, len(self.names)))
        self.model_units = units
        modules: OrderedDict[str, nn.Module] = OrderedDict(zip(units.names, units.units))
        return Layers(modules, units.io, units.shared, units.written)

    def agree(self, layers: Layers | None, deferred: bool, error: Exception | None) -> None:
        if error is not None:
            raise error

    def plan(self, layers: Layers, make: Callable[[], Plan]) -> Plan:
        return make()

    def profile(self, layers: Layers) -> Profile:
        names = list(layers.modules)
        profile = self.given_profile
        if profile is not None:
            # Profiles saved before units were named by their dotted module paths wrote "/".
            if [name.replace("/", ".") for name in profile.names] != names:
                raise ValueError(
                    f"the profile's layers {profile.names} are not the model's units {names}"
                )
            return profile
        assert self.model_units is not None
        units = list(layers.modules.values())
        chunks = int(self.settings.chunks or 1)
        tensors = self.model_units.io.flatten(self.sample, self.kwargs, "sample")
        # The sizes profile_layers and the command line pick (never a batch of one under
        # a training BatchNorm), for the traced batch: the first flat input may not be it.
        layout = self.model_units.layout
        micro = -(-layout.traced[layout.primary].batch // chunks)
        return profile_layers(
            units,
            tensors,
            device=self.names[0],
            chunks=chunks,
            names=names,
            batch_sizes=default_batch_sizes(micro, smallest_batch(units)),
            autocast=self.settings.autocast,
            owner=self.model,  # names the tensors several units use by the model's names
        )

    def make_plan(self, layers: Layers, profile: Profile) -> Plan:
        # The users of a tensor written in place stay on one stage when stages would copy it.
        replicate = self.settings.replicate_shared
        copied = copied_written(layers.shared, self.names, layers.written, replicate)
        return make_plan(keep_together(profile, copied), self.names, self.settings)

    def check_placement(self, layers: Layers, plan: Plan) -> None:
        check_placement(
            layers.shared,
            stage_of_units(plan.balance),
            self.names,
            list(layers.modules),
            written=layers.written,
            replicate=self.settings.replicate_shared,
        )

    def stage_devices(self, plan: Plan) -> dict[int, str | torch.device]:
        return {k: device.name for k, device in enumerate(plan.devices)}

    def materialized(self, error: ValueError | None) -> None:
        if error is not None:
            raise error
