"""The memory guard: a layer whose counted bytes exceed the free memory is refused before
it gets storage (profiler.memory_guard)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import profiler.measure_pass
import profiler.memory_guard
from profiler.measure import profile_model
from profiler.memory_guard import MemoryShortage, format_bytes, free_bytes

WIDTH, BATCH = 64, 4
FLOAT = 4  # bytes of a float32


def _meta_model() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def _expected_bytes() -> int:
    """Measuring one Linear(64, 64) at micro-batch sizes 2 and 4, by the guard's rule."""
    state = (WIDTH * WIDTH + WIDTH) * FLOAT
    grads = 2 * state  # the accumulated gradient and the next backward's
    sizes = [BATCH // 2, BATCH]
    rows = [size * WIDTH * FLOAT for size in sizes]  # input and output bytes alike
    held = 2 * sum(rows)  # inputs and outputs at every size
    # At the largest size: the input's copy and gradient, the output and its gradient
    # (a Linear saves only its input, which is not newly allocated).
    largest = 2 * rows[-1] + 2 * rows[-1]
    return state + grads + held + largest


def _free(monkeypatch: pytest.MonkeyPatch, amount: int) -> None:
    monkeypatch.setattr(profiler.memory_guard, "free_bytes", lambda device: amount)


def test_layer_larger_than_free_memory_is_refused_before_materializing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a refused layer was materialized")

    monkeypatch.setattr(profiler.measure_pass, "materialize", forbidden)
    needed = _expected_bytes()
    free = needed  # the guard keeps a fifth of the free memory spare
    _free(monkeypatch, free)
    with pytest.raises(MemoryShortage) as caught:
        profile_model(_meta_model(), torch.randn(BATCH, WIDTH), repeats=1, warmup=0)
    shortage = caught.value
    assert (shortage.label, shortage.needed, shortage.free) == ("layer 0 (Linear)", needed, free)
    message = str(shortage)
    assert "\n" not in message
    assert "layer 0 (Linear)" in message
    assert format_bytes(needed) in message and format_bytes(free) in message
    assert "measure=False" in message and "smaller sample" in message


def test_layer_within_free_memory_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 2 * _expected_bytes())
    found = profile_model(_meta_model(), torch.randn(BATCH, WIDTH), repeats=1, warmup=0)
    assert len(found) == 2
    assert all(layer.forward[-1] > 0 for layer in found.layers)


def test_real_layers_are_guarded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 1024)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
    with pytest.raises(MemoryShortage, match=r"layer 0 \(Linear\)"):
        profile_model(model, torch.randn(BATCH, WIDTH), repeats=1, warmup=0)


def test_counting_alone_needs_no_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    _free(monkeypatch, 0)
    found = profile_model(_meta_model(), torch.randn(BATCH, WIDTH), measure=False)
    assert [layer.param_bytes for layer in found.layers] == [(WIDTH * WIDTH + WIDTH) * FLOAT] * 2


def test_free_bytes_of_the_host() -> None:
    free = free_bytes(torch.device("cpu"))
    assert free is not None and free > 0
    assert free_bytes(torch.device("meta")) is None


def test_storage_shortage_says_what_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    from profiler.memory_guard import storage_shortage

    _free(monkeypatch, 1000)
    assert storage_shortage(800, "cpu") is None  # 80% of the free memory may be taken
    assert storage_shortage(801, "cpu") == (
        "needs 801 B but the host has 1000 B free, of which 20% stays spare"
    )
    monkeypatch.setattr(profiler.memory_guard, "free_bytes", lambda device: None)
    assert storage_shortage(1 << 60, "cpu") is None  # unknown: not refused
