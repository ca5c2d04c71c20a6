"""A plan beside its baseline, every strategy priced on one cost model; a profile's devices.

``autopipe plan`` shows the chosen strategy's plan against a baseline (``uniform``, or
``optimal`` when ``uniform`` was chosen) and may draw every strategy's; they all price
the same cost model, built once from the profile here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from autopipe import PlanningError
from autopipe.planning.model.cost_model import CostModel
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.names import STRATEGIES
from autopipe.planning.model.plan_settings import build_model
from autopipe.planning.model.plans import Plan
from autopipe.planning.pipeline_settings import PipelineSettings
from autopipe.planning.planner import plan_model
from autopipe.planning.recomputed_modules import planned_profile
from profiler import Profile

__all__ = ["compare_plans", "profile_devices"]


def profile_devices(
    profile: Profile, stages: int, virtual_stages: int = 1, *, colocated: bool = False
) -> int | list[str]:
    """The stage devices to plan a profile for: named ``cuda:0``, ``cuda:1``, ... for a CUDA
    profile, else a count (devices named like the profile's).

    With ``virtual_stages`` per device there are ``stages·virtual_stages`` stages, stage s
    on device ``s % stages``; ``colocated`` puts all ``stages`` on the profile's device.
    """
    if colocated:
        return [profile.device] * stages
    if profile.device.startswith("cuda"):
        return [f"cuda:{k % stages}" for k in range(stages * virtual_stages)]
    return stages * virtual_stages


def baseline_strategy(strategy: str) -> str:
    """The strategy a plan of ``strategy`` is shown against: ``uniform`` (the even split
    every peer starts from), or ``optimal`` for a ``uniform`` plan."""
    return "optimal" if strategy == "uniform" else "uniform"


@dataclasses.dataclass
class PlanComparison:
    """The plan of the settings' strategy and its baseline.

    Attributes:
        plan: the plan of ``settings.strategy``.
        baseline: the baseline's plan, or why it does not fit.
        baseline_strategy: the baseline's strategy.
    """

    plan: Plan
    baseline: Plan | str
    baseline_strategy: str
    _profile: Profile
    _settings: PipelineSettings
    _model: CostModel

    def every_strategy(self) -> dict[str, Plan]:
        """The plans of every strategy that fits, by name, on the same cost model."""
        known = {self.plan.strategy: self.plan}
        if isinstance(self.baseline, Plan):
            known[self.baseline.strategy] = self.baseline
        return _strategy_plans(self._model, self._profile, self._settings, known)


def compare_plans(
    profile: Profile,
    devices: int | Sequence[DeviceSpec | str],
    settings: PipelineSettings,
) -> PlanComparison:
    """Plans ``settings.strategy`` and its baseline from one cost model.

    Raises:
        PlanningError: the chosen strategy's plan does not fit (the baseline's failure is
            recorded instead).
        ValueError: invalid settings.
    """
    profile = planned_profile(profile, settings)
    model = build_model(profile, devices, settings)
    result = plan_model(model, profile, settings)
    other = baseline_strategy(settings.strategy)
    baseline: Plan | str
    try:
        baseline = plan_model(model, profile, dataclasses.replace(settings, strategy=other))
    except PlanningError as exc:
        baseline = str(exc)
    return PlanComparison(result, baseline, other, profile, settings, model)


def _strategy_plans(
    model: CostModel, profile: Profile, settings: PipelineSettings, known: Mapping[str, Plan]
) -> dict[str, Plan]:
    plans: dict[str, Plan] = {}
    for name in STRATEGIES:
        if name in known:
            plans[name] = known[name]
            continue
        try:
            plans[name] = plan_model(model, profile, dataclasses.replace(settings, strategy=name))
        except PlanningError:  # a strategy that does not fit is left out of the picture
            continue
    return plans
