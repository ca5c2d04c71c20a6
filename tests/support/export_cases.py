"""Plans of named layers split as a test asks, for the tests of the plan exports (no torch)."""

from __future__ import annotations

import dataclasses

from autopipe import Plan, plan
from tests.support.planning_cases import linear_profile


def named_plan(names: list[str], balance: list[int], virtual: int = 1) -> Plan:
    """A plan of layers named ``names`` split as ``balance`` (K·v stages, v per rank)."""
    profile = linear_profile([1.0] * len(names))
    layers = [dataclasses.replace(layer, name=n) for layer, n in zip(profile.layers, names)]
    made = plan(dataclasses.replace(profile, layers=layers), len(balance), virtual_stages=virtual)
    stages, start = [], 0
    for k, size in enumerate(balance):
        held = names[start : start + size]
        span = dataclasses.replace(made.stages[k], start=start, stop=start + size, layers=held)
        stages.append(dataclasses.replace(span, index=k))
        start += size
    return dataclasses.replace(made, balance=list(balance), stages=stages)
