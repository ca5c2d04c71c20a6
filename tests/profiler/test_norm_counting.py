"""The bytes re-computing a layer's norms frees and the work it runs again, counted."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from profiler import profile_model

H = 16
TOKENS = (8, 10)  # batch, sequence


class Block(nn.Module):
    """A pre-norm MLP block: the RMSNorm's output is saved by the projection after it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.up = nn.Linear(H, 4 * H)
        self.down = nn.Linear(4 * H, H)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TwoNorms(nn.Module):
    """A LayerNorm and an RMSNorm, each output taken by a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.LayerNorm(H), nn.RMSNorm(H)
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.a(self.first(x))
        return h + self.b(self.second(h))


def _norm_output() -> int:
    """Bytes of one norm's float32 output at the sample's batch."""
    return TOKENS[0] * TOKENS[1] * H * 4


def test_a_norms_saved_output_is_counted_with_its_forward_work() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for measure in (False, True):
        found = profile_model(
            model, torch.randn(*TOKENS, H), measure=measure, batch_sizes=[TOKENS[0]]
        )
        for layer in found.layers:
            assert layer.norm_saved == [_norm_output()]
            assert layer.norm_saved[0] < layer.saved[0]
            assert layer.norm_traffic is not None and layer.traffic is not None
            assert 0 < layer.norm_traffic[0] < layer.traffic[0]
            assert layer.norm_operations is not None and layer.norm_operations[0] >= 1


def test_every_norm_of_a_layer_counts() -> None:
    torch.manual_seed(0)
    found = profile_model(
        nn.Sequential(TwoNorms()), torch.randn(*TOKENS, H), measure=False, batch_sizes=[8]
    )
    assert found.layers[0].norm_saved == [2 * _norm_output()]


def test_a_traced_unit_counts_its_inlined_norms_as_the_modules_do() -> None:
    torch.manual_seed(0)
    block, x = Block(), torch.randn(*TOKENS, H)
    # torch.export inlines the modules: the norm is nodes carrying its module stack.
    graph = torch.export.export(block, (x,)).module()
    assert not any(isinstance(m, nn.RMSNorm) for m in graph.modules())
    plain = profile_model(nn.Sequential(block), x, measure=False, batch_sizes=[8])
    traced = profile_model(nn.Sequential(graph), x, measure=False, batch_sizes=[8])
    assert traced.layers[0].norm_saved == plain.layers[0].norm_saved == [_norm_output()]
    assert traced.layers[0].norm_traffic == plain.layers[0].norm_traffic


def test_a_layer_without_norms_counts_none() -> None:
    found = profile_model(
        nn.Sequential(nn.Linear(H, H), nn.ReLU()), torch.randn(8, H), measure=False
    )
    assert all(layer.norm_saved == [0] * len(found.batch_sizes) for layer in found.layers)
    assert all(layer.norm_flops == [0.0] * len(found.batch_sizes) for layer in found.layers)


class CastingRMSNorm(nn.Module):
    """Hugging Face's RMSNorm: a cast of its input first (none at float32: the same tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))

    def forward(self, x: Tensor) -> Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = CastingRMSNorm()
        self.proj = nn.Linear(H, H)

    def forward(self, x: Tensor) -> Tensor:
        residual = x
        return residual + self.proj(self.input_layernorm(x))


def test_the_input_a_traced_norm_passes_on_is_not_its_output() -> None:
    # Exported, the residual reads the norm's no-op cast of its input: the same storage as
    # the input, which re-computing the norm does not free.
    torch.manual_seed(0)
    block, x = ResidualBlock(), torch.randn(*TOKENS, H)
    graph = torch.export.export(block, (x,)).module()
    plain = profile_model(nn.Sequential(block), x, measure=False, batch_sizes=[8])
    traced = profile_model(nn.Sequential(graph), x, measure=False, batch_sizes=[8])
    assert traced.layers[0].norm_saved == plain.layers[0].norm_saved == [_norm_output()]


class SharedNorm(nn.Module):
    """One RMSNorm called twice, a projection between: each call its own region."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.a, self.b = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.a(self.norm(x))
        return h + self.b(self.norm(h))


def test_a_norm_called_twice_counts_each_call_alone() -> None:
    torch.manual_seed(0)
    block, x = SharedNorm(), torch.randn(*TOKENS, H)
    graph = torch.export.export(block, (x,)).module()
    plain = profile_model(nn.Sequential(block), x, measure=False, batch_sizes=[8])
    traced = profile_model(nn.Sequential(graph), x, measure=False, batch_sizes=[8])
    assert traced.layers[0].norm_saved == plain.layers[0].norm_saved == [2 * _norm_output()]
    # The projection between the calls is no norm's work.
    assert traced.layers[0].norm_flops == plain.layers[0].norm_flops
    assert traced.layers[0].norm_traffic == plain.layers[0].norm_traffic
