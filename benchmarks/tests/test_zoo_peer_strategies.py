"""The peer strategies on the benchmark zoo's units, against the peers' own packages
(tests/planning/split/test_peer_strategies.py checks them on random costs; the zoo lives with the
benchmarks, which tests/ does not import; both take the peers' functions from
tests/support/peer_references.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import autopipe
from autopipe.errors import PlanningError
from tests.support.peer_references import (
    check_blockpartition,
    deepspeed_counts,
    package,
    titan_counts,
)

# --- the benchmark zoo's profiles ------------------------------------------------------


@pytest.fixture(scope="module")
def zoo() -> dict[str, tuple[Any, Any]]:
    """Each zoo model's units and a profile of them: their names and parameter bytes, and
    seeded lognormal times (conformance needs the same costs on both sides, not measured
    ones: timing every zoo model would take minutes)."""
    package("torch")
    from autopipe.cli.model_file import as_sequential
    from benchmarks.models import ZOO, llama_untied
    from profiler.profile import LayerProfile, Profile

    rng = random.Random(11)
    out = {}
    for name, module in {**ZOO, "llama_untied": llama_untied}.items():
        seq, _ = as_sequential(module.model(), module.sample())
        layers = []
        for unit_name, unit in seq.named_children():
            forward = [rng.lognormvariate(-7.0, 1.0), rng.lognormvariate(-7.0, 1.0)]
            layers.append(
                LayerProfile(
                    name=unit_name,
                    kind=type(unit).__name__,
                    forward=forward,
                    backward=[2 * t for t in forward],
                    saved=[0, 0],
                    output=[0, 0],
                    param_bytes=sum(p.numel() * p.element_size() for p in unit.parameters()),
                )
            )
        profile = Profile(layers=layers, batch_sizes=[1, 2], input=[0, 0], batch_size=4, chunks=2)
        out[name] = (seq, profile)
    return out


def _stage_counts(units: int) -> list[int]:
    return [k for k in (2, 3, 4, 8) if k <= units]


def test_zoo_parameters_is_deepspeeds(
    zoo: dict[str, tuple[Any, Any]], deepspeed_utils: ModuleType
) -> None:
    for name, (seq, profile) in zoo.items():
        # What PipelineModule._count_layer_params counts: each layer's trainable elements.
        counts = [sum(p.numel() for p in unit.parameters() if p.requires_grad) for unit in seq]
        for k in _stage_counts(len(seq)):
            ours = autopipe.plan(profile, k, strategy="parameters", checkpoint="never")
            assert ours.balance == deepspeed_counts(deepspeed_utils, counts, k), (name, k)


def test_zoo_blockpartition_is_torchgpipes(
    zoo: dict[str, tuple[Any, Any]], solve: Callable[..., Any]
) -> None:
    for _, profile in zoo.values():
        for size in range(len(profile.batch_sizes)):
            # What balance_by_time hands solve: forward + backward, whole microseconds.
            costs = [
                int((layer.forward[size] + layer.backward[size]) * 1_000_000)
                for layer in profile.layers
            ]
            for k in _stage_counts(len(costs)):
                check_blockpartition(solve, costs, k)


def test_zoo_torchtitan_is_torchtitans(
    zoo: dict[str, tuple[Any, Any]], titan: Callable[..., Any]
) -> None:
    from autopipe.planning.split.titan_split import has_titan_shape

    decoders = {"gpt2", "llama_untied"}
    for name, (_, profile) in zoo.items():
        names = [layer.name for layer in profile.layers]
        assert has_titan_shape(names) == (name in decoders), name
        if name not in decoders:
            with pytest.raises(PlanningError, match="torchtitan"):
                autopipe.plan(profile, 2, strategy="torchtitan")
            continue
        layer_units = [n for n in names if n.split("/")[-1].isdigit()]
        head = names.index(layer_units[0])
        tail = len(names) - 1 - names.index(layer_units[-1])
        for k in (1, 2, 3, 4):
            counts = titan_counts(titan(k, len(layer_units)))
            expected = list(counts)
            expected[0] += head
            expected[-1] += tail
            ours = autopipe.plan(profile, k, strategy="torchtitan", checkpoint="never")
            assert ours.balance == expected, (name, k)
