"""Each peer strategy against its own package: torchgpipe, DeepSpeed, Megatron-LM, torchtitan.

Seeded random cost vectors (lengths 1..40, every stage count, ties, zeros) and the profiles
of the benchmark zoo; a test is skipped, with the reason, only where its package is not
installed.
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import autopipe
from autopipe.errors import PlanningError
from autopipe.planning.split.titan_split import titan_layer_counts

CASES = 1200


def _package(name: str) -> ModuleType:
    return pytest.importorskip(name, reason=f"{name} is not installed")


@pytest.fixture(scope="module")
def solve() -> Callable[..., Any]:
    return _package("torchgpipe.balance.blockpartition").solve


@pytest.fixture(scope="module")
def deepspeed_utils() -> ModuleType:
    return _package("deepspeed.runtime.utils")


@pytest.fixture(scope="module")
def titan() -> Callable[..., list[list[str]]]:
    return _package("torchtitan.distributed.pipeline_parallel")._generate_llm_fqn_per_model_part


def _vector(rng: random.Random) -> tuple[list[float], int]:
    """Costs of one of five kinds (small integers with ties, lognormal floats, zeros and
    spikes, all equal, big integers) and a stage count, often one that does not divide."""
    n = rng.randint(1, 40)
    kind = rng.randrange(5)
    if kind == 0:
        costs: list[float] = [rng.randint(0, 5) for _ in range(n)]
    elif kind == 1:
        costs = [rng.lognormvariate(0.0, 1.5) for _ in range(n)]
    elif kind == 2:
        costs = [rng.choice([0, 0, 1, 10, 100]) for _ in range(n)]
    elif kind == 3:
        costs = [rng.choice([0, 3, 7])] * n
    else:
        costs = [rng.randint(0, 10**7) for _ in range(n)]
    return costs, rng.randint(1, n)


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


def _check_blockpartition(solve: Callable[..., Any], costs: list[float], k: int) -> str:
    """Asserts that ours is torchgpipe's balance, or refused exactly where torchgpipe's is
    unusable; returns what happened."""
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


def test_blockpartition_is_torchgpipes_on_random_costs(solve: Callable[..., Any]) -> None:
    rng = random.Random(2024)
    seen: dict[str, int] = {}
    for _ in range(CASES):
        costs, k = _vector(rng)
        outcome = _check_blockpartition(solve, costs, k)
        seen[outcome] = seen.get(outcome, 0) + 1
    assert seen["same"] >= CASES * 3 // 4  # most vectors do get a split


@pytest.mark.parametrize(
    ("costs", "k", "theirs"),
    [([1, 1, 1], 2, [1, 2]), ([1] * 7, 3, [2, 2, 3]), ([70, 55, 80], 2, [1, 2])],
)
def test_blockpartition_equal_count_start(
    solve: Callable[..., Any], costs: list[float], k: int, theirs: list[int]
) -> None:
    assert [len(block) for block in solve(costs, k)] == theirs
    assert autopipe.partition(costs, k, strategy="blockpartition") == theirs


def test_blockpartition_on_lognormal_benchmark_sizes(solve: Callable[..., Any]) -> None:
    # The shape of the planning benchmark: 4K..16K layers, integer microseconds.
    rng = random.Random(7)
    for k in (2, 4, 8, 16):
        for _ in range(5):
            n = rng.randint(4 * k, 16 * k)
            costs = [int(rng.lognormvariate(0.0, 1.0) * 1e3) for _ in range(n)]
            _check_blockpartition(solve, costs, k)


def _deepspeed_counts(utils: ModuleType, weights: list[float], k: int) -> list[int]:
    parts = [int(p) for p in utils.partition_balanced(weights, k)]
    return [b - a for a, b in itertools.pairwise(parts)]


def test_parameters_is_deepspeeds_on_random_weights(deepspeed_utils: ModuleType) -> None:
    rng = random.Random(2025)
    for _ in range(CASES):
        weights, k = _vector(rng)
        ours = autopipe.partition([1.0] * len(weights), k, memory=weights, strategy="parameters")
        assert ours == _deepspeed_counts(deepspeed_utils, weights, k), (weights, k)


def test_parameters_known_instances(deepspeed_utils: ModuleType) -> None:
    weights = [6, 5, 9, 3]
    theirs = _deepspeed_counts(deepspeed_utils, weights, 3)
    assert autopipe.partition([1] * 4, 3, memory=weights, strategy="parameters") == theirs
    assert theirs == [1, 1, 2]  # largest stage 12; the min-max split holds 11


def test_uniform_is_deepspeeds(deepspeed_utils: ModuleType) -> None:
    for n in range(1, 61):
        for k in range(1, n + 1):
            parts = [int(p) for p in deepspeed_utils.partition_uniform(n, k)]
            theirs = [b - a for a, b in itertools.pairwise(parts)]
            assert autopipe.partition([1.0] * n, k, strategy="uniform") == theirs


def test_uniform_is_megatrons_where_megatron_splits() -> None:
    torch = _package("torch")
    _package("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    def megatron(layers: int, k: int) -> list[int] | None:
        try:
            config = TransformerConfig(
                num_layers=layers,
                hidden_size=8,
                num_attention_heads=2,
                pipeline_model_parallel_size=k,
                pipeline_dtype=torch.float32,
            )
            return [get_num_layers_to_build(config, pp_rank=r) for r in range(k)]
        except (AssertionError, ValueError):
            return None

    for layers in range(2, 13):
        for k in range(2, min(layers, 6) + 1):
            theirs = megatron(layers, k)
            ours = autopipe.partition([1.0] * layers, k, strategy="uniform")
            if layers % k == 0:
                assert theirs == ours
            else:  # Megatron refuses a count that does not divide; DeepSpeed does not
                assert theirs is None


def _titan_counts(parts: list[list[str]]) -> list[int]:
    return [sum(name.startswith("layers.") for name in part) for part in parts]


def test_torchtitan_layer_counts_are_torchtitans(titan: Callable[..., Any]) -> None:
    for layers in range(0, 41):
        for k in range(1, 25):
            try:
                theirs: list[int] | None = _titan_counts(titan(k, layers))
            except ValueError:
                theirs = None
            try:
                ours: list[int] | None = titan_layer_counts(k, layers)
            except PlanningError:
                ours = None
            assert ours == theirs, (layers, k)
