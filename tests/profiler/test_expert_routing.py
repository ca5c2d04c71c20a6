"""The routing assumed for a mixture of experts counted without values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from profiler.count_pass import count_layers
from profiler.expert_routing import assumed_forward, assumed_tokens, check_skew
from tests.support.moe_models import moe_block


def test_balanced_routing_gives_each_expert_its_share() -> None:
    assert assumed_tokens(12, 2, 4) == [6, 6, 6, 6]
    # 10 * 2 = 20 copies over 8 experts: the remainder, one more each, to the first ones.
    assert assumed_tokens(10, 2, 8) == [3, 3, 3, 3, 2, 2, 2, 2]


def test_skew_makes_the_busiest_expert_receive_skew_times_the_mean() -> None:
    counts = assumed_tokens(32, 2, 8, skew=2.75)  # mean 8
    assert counts == [22, 6, 6, 6, 6, 6, 6, 6]
    # Uneven rest: spread one more each over the first of the others.
    assert assumed_tokens(12, 2, 4, skew=1.5) == [9, 5, 5, 5]


def test_the_busiest_expert_receives_each_token_at_most_once() -> None:
    counts = assumed_tokens(16, 2, 8, skew=100.0)
    assert counts[0] == 16
    assert sum(counts) == 32
    assert max(counts[1:]) <= counts[0]


@pytest.mark.parametrize("bad", [0.5, 0, -1, math.inf, math.nan, "2", True, None])
def test_a_skew_below_one_or_not_a_number_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="expert_skew must be a"):
        check_skew(bad)


def test_check_skew_returns_a_float() -> None:
    assert check_skew(2) == 2.0


class _Shapes(TorchDispatchMode):
    """The rows of each matmul with an expert's weight, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.mm.default:
            self.rows.append(int(args[0].shape[0]))
        return func(*args, **(kwargs or {}))


def _routed_rows(skew: float) -> list[int]:
    """The rows of each expert's up projection in the assumed loop (12 tokens, top-2 of 4)."""
    experts = moe_block("mixtral").experts
    hidden = torch.randn(12, 16, dtype=torch.float64)
    weights = torch.rand(12, 2, dtype=torch.float64)
    index = torch.zeros(12, 2, dtype=torch.long)
    shapes = _Shapes()
    with shapes, torch.no_grad():
        assumed_forward(experts, hidden, index, weights, skew, lambda call: None)
    return shapes.rows[::2]  # up, then down projection per expert


def test_the_assumed_loop_runs_each_expert_on_its_assumed_tokens() -> None:
    assert _routed_rows(1.0) == [6, 6, 6, 6]
    assert _routed_rows(1.5) == [9, 5, 5, 5]


class _ListedExperts(nn.Module):
    """A mixture of experts held as separate modules, routed by reading the router."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        choice = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return out


def test_routing_read_by_the_models_own_code_is_refused_naming_the_block() -> None:
    with torch.device("meta"):
        layer = _ListedExperts()
    inputs = [(torch.empty(6, 8, device="meta"),)]
    with pytest.raises(ValueError) as caught:
        count_layers([layer], inputs, ["moe"], torch.device("cpu"))
    message = str(caught.value)
    assert message.startswith("cannot count layer moe (_ListedExperts) without tensor values:")
    assert "its mixture of experts experts (ModuleList of 4 Linear)" in message
    assert "experts(hidden_states, top_k_index, top_k_weights)" in message
    assert "\n" not in message
