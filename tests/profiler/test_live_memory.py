"""Tests of live saved-for-backward memory tracking (profiler.live_memory)."""

from __future__ import annotations

import gc

import torch
from torch import nn

from autopipe import GPipe
from profiler import profile_model
from profiler.live_memory import SavedMemory


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())


def test_peak_is_what_the_profiler_counts_and_everything_is_released() -> None:
    model = _model()
    x = torch.randn(8, 16)
    profile = profile_model(model, x, batch_sizes=[8], warmup=0, repeats=1)
    with SavedMemory.of_modules(model) as saved:
        out = model(x.requires_grad_())
        held = saved.live
        out.sum().backward()
        del out
        gc.collect()
    assert held == saved.peak > 0
    # The profiler counts each layer's saved storages alone; a storage saved by two
    # layers (an output that the next layer saves as its input) counts once here.
    per_layer = sum(layer.saved[0] for layer in profile.layers)
    assert saved.peak <= per_layer
    assert saved.live == 0


def test_gpipe_checkpointing_holds_less_than_keeping_everything() -> None:
    x = torch.randn(32, 16)
    peaks = {}
    for mode in ("never", "always"):
        pipe = GPipe(_model(), [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=mode)
        with SavedMemory.of_modules(pipe) as saved:
            pipe(x).sum().backward()
        peaks[mode] = saved.peak
        assert saved.live == 0
        pipe.close()
    assert 0 < peaks["always"] < peaks["never"]


def test_parameters_are_excluded_and_reset_peak() -> None:
    layer = nn.Linear(4, 4, bias=False)
    with SavedMemory(exclude=layer.parameters()) as saved:
        y = layer(torch.randn(2, 4, requires_grad=True))
        # Linear saves its input (and the weight, excluded).
        assert saved.live == 2 * 4 * 4
        saved.reset_peak()
        assert saved.peak == saved.live
        del y
    assert saved.live == 0


def test_one_stage_plan_predicts_the_measured_activations() -> None:
    from autopipe.planning.planner import evaluate

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)
    )
    x = torch.randn(8, 16)
    profile = profile_model(model, x, batch_sizes=[4, 8], warmup=0, repeats=1)
    # Tanh and ReLU save their outputs, which the next Linear saves as its input.
    assert [layer.shared for layer in profile.layers] == [
        [0, 0],
        [0, 0],
        [4 * 32 * 4, 8 * 32 * 4],
        [0, 0],
        [4 * 32 * 4, 8 * 32 * 4],
    ]
    plan = evaluate(profile, [5], chunks=1, checkpoint="never")
    with SavedMemory.of_modules(model) as saved:
        model(x).sum().backward()
    assert plan.stages[0].activation_memory == saved.peak
    # Cut between Tanh and the Linear after it: the two stages hold a copy each (the
    # second one receives the boundary tensor), so that storage counts twice.
    two = evaluate(profile, [2, 3], chunks=1, checkpoint="never")
    total = sum(s.activation_memory for s in two.stages)
    assert total == saved.peak + 8 * 32 * 4
