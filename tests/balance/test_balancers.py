"""balance_by_time / balance_by_size: torchgpipe's calls, the exact split of what they measure."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import autopipe
from autopipe.balance import balance_by_size, balance_by_time, blockpartition, layer_measures


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8), nn.ReLU()
    )


def _recording(monkeypatch: pytest.MonkeyPatch, name: str) -> list[list[float]]:
    """Wraps measure.<name> so that the test sees the costs the balancer measured."""
    seen: list[list[float]] = []
    original = getattr(layer_measures, name)

    def wrapper(*args: Any) -> list[float]:
        seen.append(original(*args))
        return seen[-1]

    monkeypatch.setattr(layer_measures, name, wrapper)
    return seen


@pytest.mark.parametrize("partitions", [2, 3])
def test_balance_by_time_is_the_exact_split_of_its_measured_times(monkeypatch, partitions):
    seen = _recording(monkeypatch, "layer_times")
    balance = balance_by_time(partitions, _model(), torch.rand(32, 8), timeout=0.05, device="cpu")
    assert len(seen) == 1 and len(seen[0]) == 6
    assert balance == autopipe.partition(seen[0], partitions)


def test_balance_by_size_is_the_exact_split_of_its_measured_sizes(monkeypatch):
    seen = _recording(monkeypatch, "layer_sizes")
    balance = balance_by_size(3, _model(), torch.rand(32, 8), chunks=4, device="cpu")
    assert balance == autopipe.partition(seen[0], 3)


def test_layer_sizes_count_activations_per_micro_batch_and_scaled_parameters():
    layer = nn.Linear(4, 8)  # saves its input (not counted); its output is 8 float32
    sizes = layer_measures.layer_sizes(
        nn.Sequential(layer), torch.rand(16, 4), 2, 3.0, torch.device("cpu")
    )
    params = (4 * 8 + 8) * 4
    assert sizes == [8 * 4 * (16 / 2) + params * 3.0]


@pytest.mark.parametrize(
    "costs",
    [
        [1, 2, 3, 4, 5, 6],
        [5, 5, 5, 5, 5, 5, 5, 20],
        [9, 1, 1, 1, 7, 3],
        [0, 0, 0],
        [1] * 7,
        [70, 55, 80],
    ],
)
def test_blockpartition_strategy_equals_torchgpipes_balance_by_time(monkeypatch, costs):
    tg_balance = pytest.importorskip("torchgpipe.balance")
    partitions = 2
    model = nn.Sequential(*[nn.Identity() for _ in costs])
    monkeypatch.setattr(layer_measures, "layer_times", lambda *args: [float(c) for c in costs])
    monkeypatch.setattr(tg_balance, "profile_times", lambda *args: list(costs))
    ours = balance_by_time(
        partitions, model, torch.rand(1), device="cpu", strategy="blockpartition"
    )
    assert ours == tg_balance.balance_by_time(partitions, model, torch.rand(1), device="cpu")


def test_solve_returns_the_blocks_of_the_strategy():
    costs = [3, 1, 4, 1, 5, 9, 2, 6]
    blocks = blockpartition.solve(costs, 3)
    assert [len(b) for b in blocks] == autopipe.partition(costs, 3, strategy="blockpartition")
    assert [c for block in blocks for c in block] == costs


def test_the_model_is_left_as_it_was():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Dropout(0.5)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.rand(4, 3)
    rng = torch.get_rng_state()
    balance_by_time(2, model, sample, timeout=0.0, device="cpu")
    # Sizes are measured on one sample, which batch norm refuses in training (as torchgpipe).
    balance_by_size(2, model[::2], sample, device="cpu")
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(torch.get_rng_state(), rng)


def test_refusals():
    with pytest.raises(TypeError, match="nn.Sequential"):
        balance_by_time(1, nn.Linear(1, 1), torch.rand(1), device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot split 1 layers into 2"):
        balance_by_time(2, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), device="cpu")
    with pytest.raises(ValueError, match="unknown strategy"):
        balance_by_size(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), strategy="x")
    with pytest.raises(ValueError, match="chunks"):
        balance_by_size(1, nn.Sequential(nn.Linear(1, 1)), torch.rand(1, 1), chunks=0)
