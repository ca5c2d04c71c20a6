"""The benchmark model zoo: every model traces into units that reproduce it and plan."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

import autopipe
from autopipe.cli.model_file import as_sequential
from benchmarks.models import ZOO
from profiler.measure import profile_model


def _run_units(seq: torch.nn.Sequential, inputs: tuple[torch.Tensor, ...]) -> Any:
    """Chains the units the way the profiler does: a tuple output is passed as ``*args``."""
    x: Any = inputs
    for unit in seq:
        x = unit(*x) if isinstance(x, tuple) else unit(x)
    return x[0] if isinstance(x, tuple) and len(x) == 1 else x


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_traces_matches_and_plans(name: str) -> None:
    zoo: ModuleType = ZOO[name]
    model = zoo.model()
    sample = zoo.sample()
    seq, flat = as_sequential(model, sample)
    assert len(seq) >= 4

    args = sample if isinstance(sample, tuple) else (sample,)
    with torch.no_grad():
        expected = model(*args)
        actual = _run_units(seq, tuple(flat))
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)

    profile = profile_model(seq, tuple(flat), chunks=2, repeats=1, warmup=0)
    plan = autopipe.plan(profile, 2)
    assert sum(plan.balance) == len(seq)
    assert len(plan.balance) == 2


def test_zoo_samples_are_deterministic() -> None:
    for zoo in ZOO.values():
        first, second = zoo.sample(), zoo.sample()
        first = first if isinstance(first, tuple) else (first,)
        second = second if isinstance(second, tuple) else (second,)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
