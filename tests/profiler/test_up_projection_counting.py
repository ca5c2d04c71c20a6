"""The bytes re-computing a latent attention's up-projections frees and the work it runs
again, counted."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from profiler import profile_model
from tests.support.moe_models import deepseek_v3

BATCH, SEQUENCE = 2, 6
# The small DeepSeek-V3's attention: 4 heads, queries and keys of 4 + 4 (rotary) dims,
# values of 4, query latent 12, key/value latent 8, hidden 16.
HEADS, QK, V, Q_RANK, KV_RANK = 4, 8, 4, 12, 8


class Block(nn.Module):
    """A DeepSeek-V3 decoder layer with its rotary embedding, as a pipeline unit runs it."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device)[None]
        out: Tensor = self.layer(x, position_embeddings=self.rotary(x, positions))
        return out


def _block() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    model = deepseek_v3().to(torch.float64)
    model.set_experts_implementation("eager")
    block = Block(model.model.layers[0], model.model.rotary_emb)
    return block, torch.randn(BATCH, SEQUENCE, 16, dtype=torch.float64)


def _expected() -> tuple[int, float]:
    """The attention kernel's queries, keys and values (the values padded to the queries'
    width, as flash attention runs them), float64; the up-projections' FLOPs."""
    tokens = BATCH * SEQUENCE
    saved = 3 * tokens * HEADS * QK * 8
    flops = 2 * tokens * (Q_RANK * HEADS * QK + KV_RANK * HEADS * (QK // 2 + V))
    return saved, float(flops)


def test_the_attention_s_queries_keys_and_values_are_counted_with_their_work() -> None:
    block, x = _block()
    for measure in (False, True):
        found = profile_model(nn.Sequential(block), x, measure=measure, batch_sizes=[BATCH])
        layer = found.layers[0]
        saved, flops = _expected()
        assert layer.up_proj_saved == [saved]
        assert layer.up_proj_flops == [flops]
        assert layer.norm_saved is not None and layer.norm_saved[0] > 0  # apart from these
        assert layer.up_proj_saved[0] + layer.norm_saved[0] < layer.saved[0]
        assert layer.up_proj_traffic is not None and layer.traffic is not None
        assert 0 < layer.up_proj_traffic[0] < layer.traffic[0]


def test_a_traced_unit_counts_its_inlined_up_projections_as_the_modules_do() -> None:
    block, x = _block()
    graph = torch.export.export(block, (x,)).module()
    assert not any(isinstance(m, nn.Linear) for m in graph.modules())  # inlined
    plain = profile_model(nn.Sequential(block), x, measure=False, batch_sizes=[BATCH])
    traced = profile_model(nn.Sequential(graph), x, measure=False, batch_sizes=[BATCH])
    assert traced.layers[0].up_proj_saved == plain.layers[0].up_proj_saved == [_expected()[0]]
    assert traced.layers[0].up_proj_flops == plain.layers[0].up_proj_flops


def test_a_layer_without_up_projections_counts_none() -> None:
    found = profile_model(
        nn.Sequential(nn.Linear(16, 16), nn.ReLU()), torch.randn(8, 16), measure=False
    )
    assert all(layer.up_proj_saved == [0] * len(found.batch_sizes) for layer in found.layers)
    assert all(layer.up_proj_flops == [0.0] * len(found.batch_sizes) for layer in found.layers)


class EagerAttention(nn.Module):
    """Up-projected queries and keys whose scores an eager product makes: the scores and
    what follows are the attention's, not the region's."""

    def __init__(self) -> None:
        super().__init__()
        self.q_b_proj, self.kv_b_proj = nn.Linear(4, 16), nn.Linear(4, 32)

    def forward(self, latent: Tensor) -> Tensor:
        q = self.q_b_proj(latent)
        k, v = self.kv_b_proj(latent).chunk(2, dim=-1)
        probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return probs @ v


def test_eager_attention_s_scores_end_the_region() -> None:
    x = torch.randn(3, 5, 4)
    found = profile_model(nn.Sequential(EagerAttention()), x, measure=False)
    # q, and the key/value projection (k and v are its views): 5 × (16 + 32) floats a sample.
    assert found.layers[0].up_proj_saved == [b * 5 * (16 + 32) * 4 for b in found.batch_sizes]
