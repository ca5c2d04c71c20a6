"""The peers' own functions, as the peer-strategy tests call them: torchgpipe's
block-partition, DeepSpeed's parameter and uniform partitions and torchtitan's layer
assignment, each skipped with the reason where its package is not installed.

tests/planning/split/test_peer_strategies.py checks the strategies on random costs and
benchmarks/tests/test_zoo_peer_strategies.py on the benchmark zoo; both take these fixtures
(their conftest.py lists them) and helpers.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import autopipe
from autopipe.errors import PlanningError

__all__ = [
    "check_blockpartition",
    "deepspeed_counts",
    "deepspeed_utils",
    "package",
    "solve",
    "titan",
    "titan_counts",
]


def package(name: str) -> ModuleType:
    """The package, or the test skipped with the reason that it is not installed."""
    return pytest.importorskip(name, reason=f"{name} is not installed")


@pytest.fixture(scope="module")
def solve() -> Callable[..., Any]:
    """torchgpipe's block-partition ``solve(costs, k)``."""
    return package("torchgpipe.balance.blockpartition").solve


@pytest.fixture(scope="module")
def deepspeed_utils() -> ModuleType:
    """DeepSpeed's ``partition_balanced`` and ``partition_uniform``."""
    return package("deepspeed.runtime.utils")


@pytest.fixture(scope="module")
def titan() -> Callable[..., list[list[str]]]:
    """torchtitan's assignment of a decoder's module names to ``k`` stages."""
    return package("torchtitan.distributed.pipeline_parallel")._generate_llm_fqn_per_model_part


class _Budget(Exception):
    pass


def _run_solve(solve: Callable[..., Any], costs: list[float], k: int) -> list[int] | None:
    """torchgpipe's balance, or ``None`` when its loop runs past a budget of executed lines
    far above any run that ends (its loop has no bound; no clock involved)."""
    budget = 200 * len(costs) * k
    executed = 0

    def line(frame: Any, event: str, arg: Any) -> Any:
        nonlocal executed
        if event == "line":
            executed += 1
            if executed > budget:
                raise _Budget
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code is solve.__code__ else None

    sys.settrace(call)
    try:
        return [len(block) for block in solve(costs, k)]
    except _Budget:
        return None
    finally:
        sys.settrace(None)


def _ours(costs: list[float], k: int) -> list[int] | str:
    try:
        return autopipe.partition(costs, k, strategy="blockpartition")
    except PlanningError as exc:
        return str(exc)


def check_blockpartition(solve: Callable[..., Any], costs: list[float], k: int) -> str:
    """Asserts that ours is torchgpipe's balance, or refused exactly where torchgpipe's is
    unusable; returns what happened (``same``, ``endless`` or ``empty stage``)."""
    theirs = _run_solve(solve, costs, k)
    ours = _ours(costs, k)
    if theirs is None:
        assert isinstance(ours, str) and "does not stop" in ours, (costs, k, ours)
        return "endless"
    if min(theirs) < 1 or sum(theirs) != len(costs):
        assert isinstance(ours, str) and "leaves" in ours, (costs, k, ours, theirs)
        return "empty stage"
    assert ours == theirs, (costs, k)
    return "same"


def deepspeed_counts(utils: ModuleType, weights: list[float], k: int) -> list[int]:
    """The layers per stage of DeepSpeed's ``partition_balanced`` of ``weights``."""
    parts = [int(p) for p in utils.partition_balanced(weights, k)]
    return [b - a for a, b in itertools.pairwise(parts)]


def titan_counts(parts: list[list[str]]) -> list[int]:
    """The decoder layers (``layers.N``) in each of torchtitan's stages."""
    return [sum(name.startswith("layers.") for name in part) for part in parts]
