"""``assemble``: the build path's steps in their one order, for any runner's steps."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
import torch
from torch import nn

from autopipe import plan
from autopipe.microbatching.assembly import Layers, assemble
from autopipe.planning.model.plans import Plan
from autopipe.planning.pipeline_settings import PipelineSettings
from profiler.profile import Profile
from tests.support.planning_cases import linear_profile


class _Recorded:
    """Steps that record what the build path asks of them, and in which order."""

    def __init__(self, layers: OrderedDict[str, nn.Module], given: Plan | None = None) -> None:
        self.modules, self.given, self.calls = layers, given, []
        self.profile_used: Profile = linear_profile([1.0] * len(layers), chunks=2)

    def layers(self) -> Layers:
        self.calls.append("layers")
        return Layers(OrderedDict(self.modules))

    def agree(self, layers: Layers | None, deferred: bool, error: Exception | None) -> None:
        self.calls.append(f"agree deferred={deferred}")
        if error is not None:
            raise error

    def plan(self, layers: Layers, make: Callable[[], Plan]) -> Plan:
        self.calls.append("plan")
        return make()

    def profile(self, layers: Layers) -> Profile:
        self.calls.append("profile")
        return self.profile_used

    def make_plan(self, layers: Layers, profile: Profile) -> Plan:
        self.calls.append("make_plan")
        return plan(profile, 2, chunks=2)

    def check_placement(self, layers: Layers, plan: Plan) -> None:
        self.calls.append("check_placement")

    def stage_devices(self, plan: Plan) -> dict[int, str | torch.device]:
        self.calls.append("stage_devices")
        return {0: "cpu", 1: "cpu"}

    def materialized(self, error: ValueError | None) -> None:
        self.calls.append("materialized")
        if error is not None:
            raise error


def _model(norm: bool = False) -> nn.Sequential:
    layers = [nn.Linear(4, 4), nn.BatchNorm1d(4) if norm else nn.ReLU(), nn.Linear(4, 2)]
    return nn.Sequential(*layers)


def test_the_steps_run_in_one_order() -> None:
    model = _model()
    steps = _Recorded(OrderedDict(model.named_children()))
    built = assemble(model, PipelineSettings(chunks=2), steps)
    assert steps.calls == [
        "layers",
        "agree deferred=False",
        "plan",
        "profile",
        "make_plan",
        "check_placement",
        "stage_devices",
    ]  # nothing on meta: nothing to materialize
    assert len(built.plan.balance) == 2 and sum(built.plan.balance) == 3
    assert list(built.layers.modules) == ["0", "1", "2"]
    assert built.stage_devices == {0: "cpu", 1: "cpu"} and not built.deferred


def test_a_given_plan_is_neither_profiled_nor_made() -> None:
    model = _model()
    given = plan(linear_profile([1.0, 1.0, 1.0], chunks=2), 2, chunks=2)
    steps = _Recorded(OrderedDict(model.named_children()), given)
    assert assemble(model, PipelineSettings(chunks=2), steps).plan is given
    assert "profile" not in steps.calls and "make_plan" not in steps.calls
    assert "check_placement" in steps.calls  # a given plan is placed as any other


def test_batch_norm_is_deferred_before_the_ranks_agree() -> None:
    model = _model(norm=True)
    steps = _Recorded(OrderedDict(model.named_children()))
    built = assemble(model, PipelineSettings(chunks=2), steps)
    assert "agree deferred=True" in steps.calls and built.deferred
    assert built.layers.originals[1] is model[1]  # the model's own module is left as is
    assert built.layers.modules["1"] is not model[1]
    # One micro-batch splits nothing: nothing to defer.
    steps = _Recorded(OrderedDict(model.named_children()))
    assert not assemble(model, PipelineSettings(chunks=1), steps).deferred


def test_a_refused_argument_reaches_agree_and_stops_there() -> None:
    model = _model()
    steps = _Recorded(OrderedDict(model.named_children()))
    settings = PipelineSettings(chunks=2, deferred_batch_norm="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="deferred_batch_norm must be True, False or None"):
        assemble(model, settings, steps)
    assert steps.calls == ["layers", "agree deferred=False"]


def test_meta_stages_are_materialized_where_the_steps_say() -> None:
    with torch.device("meta"):
        model = _model()
    steps = _Recorded(OrderedDict(model.named_children()))
    assemble(model, PipelineSettings(chunks=2), steps)
    assert steps.calls[-1] == "materialized"
    # Both stages are this process's: every tensor has storage, on their device.
    assert all(t.device.type == "cpu" for t in model.parameters())
