"""Tests of the single-process step benchmark (autopipe.gpipe.split_bench)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autopipe.gpipe.split_bench import pipeline_input, time_splits
from autopipe.planning.planner import evaluate
from profiler import profile_model
from profiler.live_memory import SavedMemory
from tests.support.bench_models import build


def _plans(checkpoint: str) -> tuple[nn.Sequential, torch.Tensor, dict]:
    layers, sample = build()
    profile = profile_model(layers, sample, device="cpu", chunks=2, repeats=1, warmup=0)
    options: dict[str, Any] = {"chunks": 2, "checkpoint": checkpoint, "optimizer": "sgd"}
    plans = {
        "even": evaluate(profile, [2, 2], 2, strategy="even", **options),
        "front": evaluate(profile, [3, 1], 2, strategy="front", **options),
    }
    return layers, sample, plans


def test_time_splits_times_every_split() -> None:
    layers, sample, plans = _plans("never")
    seen = []
    result = time_splits(
        layers,
        sample,
        plans,
        steps=3,
        warmup=1,
        devices=["cpu", "cpu"],
        progress=lambda done, total, label: seen.append((done, total, label)),
    )
    assert set(result) == {"even", "front"}
    for measured in result.values():
        assert len(measured.times) == 3
        assert all(t > 0 for t in measured.times)
    # The splits take turns, one step each.
    assert [label for _, _, label in seen] == ["even", "front"] * 4
    assert seen[-1][:2] == (8, 8)
    # The benchmark trains copies: the model itself is left as it was.
    first, fresh = layers[0], build()[0][0]
    assert isinstance(first, nn.Linear) and isinstance(fresh, nn.Linear)
    assert torch.equal(first.weight, fresh.weight)


def test_saved_bytes_match_plain_pytorch() -> None:
    layers, sample, plans = _plans("never")
    result = time_splits(layers, sample, plans, steps=1, warmup=0, devices=["cpu", "cpu"])
    for label, balance in (("even", [2, 2]), ("front", [3, 1])):
        # Fill-drain in plain PyTorch: every micro-batch's forward, then the backward; a
        # stage's inputs are the micro-batches (views of the sample) or the previous
        # stage's outputs, received as new tensors.
        inputs, start, expected = list(sample.chunk(2)), 0, []
        for size in balance:
            part = layers[start : start + size]
            start += size
            with SavedMemory.of_modules(part) as saved:
                outputs = [part(x) for x in inputs]
                torch.stack([y.mean() for y in outputs]).sum().backward()
            expected.append(saved.peak)
            inputs = [y.detach().clone() for y in outputs]
        assert result[label].saved_peak == expected


def test_time_splits_refuses_no_steps() -> None:
    layers, sample, plans = _plans("except_last")
    with pytest.raises(ValueError, match="at least one timed step"):
        time_splits(layers, sample, plans, steps=0)


def test_pipeline_input() -> None:
    x = torch.tensor([[1.0, 3.0]])
    layers = nn.Sequential(nn.Identity())
    assert pipeline_input(layers, x) is x
    assert pipeline_input(layers, (x,)) is x
