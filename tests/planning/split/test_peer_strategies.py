"""Each peer strategy against its own package: torchgpipe, DeepSpeed, Megatron-LM, torchtitan.

Seeded random cost vectors (lengths 1..40, every stage count, ties, zeros) and the profiles
of the benchmark zoo; a test is skipped, with the reason, only where its package is not
installed (the peers' functions and the fixtures that load them:
tests/support/peer_references.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import autopipe
from autopipe.errors import PlanningError
from autopipe.planning.split.titan_split import titan_layer_counts
from tests.support.peer_references import (
    check_blockpartition,
    deepspeed_counts,
    package,
    titan_counts,
)

CASES = 1200


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


def test_blockpartition_is_torchgpipes_on_random_costs(solve: Callable[..., Any]) -> None:
    rng = random.Random(2024)
    seen: dict[str, int] = {}
    for _ in range(CASES):
        costs, k = _vector(rng)
        outcome = check_blockpartition(solve, costs, k)
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
            check_blockpartition(solve, costs, k)


def test_parameters_is_deepspeeds_on_random_weights(deepspeed_utils: ModuleType) -> None:
    rng = random.Random(2025)
    for _ in range(CASES):
        weights, k = _vector(rng)
        ours = autopipe.partition([1.0] * len(weights), k, memory=weights, strategy="parameters")
        assert ours == deepspeed_counts(deepspeed_utils, weights, k), (weights, k)


def test_parameters_known_instances(deepspeed_utils: ModuleType) -> None:
    weights = [6, 5, 9, 3]
    theirs = deepspeed_counts(deepspeed_utils, weights, 3)
    assert autopipe.partition([1] * 4, 3, memory=weights, strategy="parameters") == theirs
    assert theirs == [1, 1, 2]  # largest stage 12; the min-max split holds 11


def test_uniform_is_deepspeeds(deepspeed_utils: ModuleType) -> None:
    for n in range(1, 61):
        for k in range(1, n + 1):
            parts = [int(p) for p in deepspeed_utils.partition_uniform(n, k)]
            theirs = [b - a for a, b in itertools.pairwise(parts)]
            assert autopipe.partition([1.0] * n, k, strategy="uniform") == theirs


def test_uniform_is_megatrons_where_megatron_splits() -> None:
    torch = package("torch")
    package("megatron.core")
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


def test_torchtitan_layer_counts_are_torchtitans(titan: Callable[..., Any]) -> None:
    for layers in range(0, 41):
        for k in range(1, 25):
            try:
                theirs: list[int] | None = titan_counts(titan(k, layers))
            except ValueError:
                theirs = None
            try:
                ours: list[int] | None = titan_layer_counts(k, layers)
            except PlanningError:
                ours = None
            assert ours == theirs, (layers, k)
