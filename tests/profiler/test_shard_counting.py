"""Tests of profiler.shard_counting: what tensor parallelism shards, counted by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from profiler.count_pass import count_layers
from profiler.measure import profile_layers
from profiler.profile import LayerProfile
from profiler.shard_counts import ShardCounts

H, BATCHES, SEQ = 8, [2, 4], 5
F32 = 4

MLP_STYLES = {
    "0.weight": "colwise",
    "0.bias": "colwise",
    "2.weight": "rowwise",
    "2.bias": "rowwise",
}


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H))


def _one(
    layer: nn.Module, sample: Tensor, styles: dict[str, str], **options: object
) -> tuple[LayerProfile, ShardCounts]:
    profile = profile_layers(
        [layer], sample, batch_sizes=BATCHES, measure=False, shard_styles=[styles], **options
    )
    found = profile.layers[0]
    assert found.shards is not None
    return found, found.shards


def test_mlp_column_then_row() -> None:
    layer, shards = _one(_mlp(), torch.randn(4, H), MLP_STYLES)
    matmuls = [2 * b * H * 4 * H * 2 for b in BATCHES]  # two Linears; GELU counts no FLOPs
    assert shards.flops == layer.flops == matmuls
    assert shards.backward_flops == layer.backward_flops == [2 * m for m in matmuls]
    # Both matmuls and the activation move bytes; the transposed weights' views move none.
    traffic = [
        F32
        * (
            (4 * H + b * H + 4 * H * H + b * 4 * H)
            + 2 * b * 4 * H
            + (H + b * 4 * H + H * 4 * H + b * H)
        )
        for b in BATCHES
    ]
    assert shards.traffic == layer.traffic == traffic
    assert shards.param_bytes == F32 * (4 * H * H + 4 * H + H * 4 * H)  # the second bias: no
    assert shards.reduce_forward == [F32 * b * H for b in BATCHES]  # the output, whole
    assert shards.reduce_backward == [F32 * b * H for b in BATCHES]  # the input's gradient
    assert shards.reductions == 1
    # The first Linear's output and GELU's are sharded; the input is a replicated one.
    assert shards.saved == [2 * F32 * b * 4 * H for b in BATCHES]
    assert shards.replicated_saved == [F32 * b * H for b in BATCHES]
    assert [
        s + r for s, r in zip(shards.saved, shards.replicated_saved, strict=True)
    ] == layer.saved
    assert (shards.attention_calls, shards.heads, shards.kv_heads) == (0, 0, 0)
    assert shards.backward_input_flops == layer.backward_input_flops


def test_without_styles_nothing_is_sharded() -> None:
    layer, shards = _one(_mlp(), torch.randn(4, H), {})
    assert shards.flops == shards.traffic == shards.saved == [0, 0]
    assert shards.param_bytes == shards.reductions == 0
    assert shards.replicated_saved == layer.saved


class Attention(nn.Module):
    """Grouped-query attention: ``KV`` key and value heads serve ``HEADS`` query heads."""

    HEADS, KV, DIM = 4, 2, 4

    def __init__(self, repeat: bool) -> None:
        super().__init__()
        self.repeat = repeat
        self.q = nn.Linear(H, self.HEADS * self.DIM, bias=False)
        self.k = nn.Linear(H, self.KV * self.DIM, bias=False)
        self.v = nn.Linear(H, self.KV * self.DIM, bias=False)
        self.o = nn.Linear(self.HEADS * self.DIM, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.HEADS, self.DIM).transpose(1, 2)
        k = self.k(x).view(b, s, self.KV, self.DIM).transpose(1, 2)
        v = self.v(x).view(b, s, self.KV, self.DIM).transpose(1, 2)
        if self.repeat:  # as Hugging Face's repeat_kv
            group = self.HEADS // self.KV
            k = k[:, :, None].expand(b, self.KV, group, s, self.DIM).reshape(b, -1, s, self.DIM)
            v = v[:, :, None].expand(b, self.KV, group, s, self.DIM).reshape(b, -1, s, self.DIM)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


ATTENTION_STYLES = {"q.weight": "colwise", "k.weight": "colwise", "v.weight": "colwise"}


@pytest.mark.parametrize("repeat", [False, True], ids=["gqa", "repeated"])
def test_attention_with_grouped_keys(repeat: bool) -> None:
    styles = {**ATTENTION_STYLES, "o.weight": "rowwise"}
    layer, shards = _one(Attention(repeat), torch.randn(4, SEQ, H), styles)
    a = Attention
    queries = [(b, a.HEADS, SEQ, a.DIM) for b in BATCHES]
    keys = [(b, a.KV, SEQ, a.DIM) for b in BATCHES]
    assert (shards.heads, shards.kv_heads, shards.attention_calls) == (a.HEADS, a.KV, 1)
    assert shards.attention_flops == [sdpa_flop_count(q, k, k) for q, k in zip(queries, keys)]
    assert shards.attention_backward_flops == [
        sdpa_backward_flop_count(q, q, k, k) for q, k in zip(queries, keys)
    ]
    assert shards.kv_bytes == [2 * F32 * b * a.KV * SEQ * a.DIM for b in BATCHES]
    # Every FLOP of the block runs on a share of the heads; one output all-reduce, and x
    # feeds three column-wise projections: its gradient is all-reduced once.
    assert shards.flops == layer.flops
    assert shards.reductions == 1
    assert shards.reduce_forward == shards.reduce_backward == [F32 * b * SEQ * H for b in BATCHES]


def test_attention_figures_without_tensor_parallelism() -> None:
    _, shards = _one(Attention(False), torch.randn(4, SEQ, H), {})
    assert (shards.heads, shards.kv_heads, shards.attention_calls) == (4, 2, 1)
    assert shards.flops == [0, 0] and shards.reductions == 0


def test_a_cast_input_is_reduced_once_under_autocast() -> None:
    styles = {**ATTENTION_STYLES, "o.weight": "rowwise"}
    _, shards = _one(Attention(False), torch.randn(4, SEQ, H), styles, autocast="bfloat16")
    assert shards.reduce_backward == [2 * b * SEQ * H for b in BATCHES]  # bfloat16, once


def test_gathered_column_and_vocabulary_sharded_embedding() -> None:
    head, shards = _one(nn.Linear(H, 20), torch.randn(4, H), {"weight": "colwise_gather_output"})
    assert shards.flops == head.flops
    assert shards.reduce_forward == [F32 * b * 20 for b in BATCHES]  # the all-gathered output
    assert shards.reduce_backward == [F32 * b * H for b in BATCHES]
    ids = torch.randint(0, 20, (4, SEQ))
    embed, shards = _one(nn.Embedding(20, H), ids, {"weight": "embedding_rowwise"})
    assert shards.param_bytes == embed.param_bytes == F32 * 20 * H
    assert shards.reduce_forward == [F32 * b * SEQ * H for b in BATCHES]
    assert (shards.reductions, shards.reduce_backward) == (1, [0, 0])


def test_local_row_partial_is_reduced_where_used() -> None:
    # A row-wise product left partial is summed whole only where a nonlinear use needs it.
    model = nn.Sequential(nn.Linear(H, 4 * H), nn.ReLU(), nn.Linear(4 * H, H), nn.Tanh())
    styles = {"0.weight": "local_colwise", "2.weight": "local_rowwise"}
    _, shards = _one(model, torch.randn(4, H), styles)
    assert shards.reductions == 1
    assert shards.reduce_forward == [F32 * b * H for b in BATCHES]
    assert shards.reduce_backward == [0, 0]  # local: no collective of its own


def test_identical_layers_count_once() -> None:
    torch.manual_seed(0)
    layers = [_mlp(), _mlp()]
    inputs = [(torch.empty(b, H, device="meta"),) for b in BATCHES]
    counted = count_layers(
        layers, inputs, ["a", "b"], torch.device("cpu"), styles=[MLP_STYLES, MLP_STYLES]
    )
    assert [c.first for c in counted] == [0, 0]
    # Other styles on the same structure are other work.
    other = count_layers(layers, inputs, ["a", "b"], torch.device("cpu"), styles=[MLP_STYLES, {}])
    assert [c.first for c in other] == [0, 1]


def test_an_unknown_style_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown tensor-parallel style 'diagonal' for 0\.weight"):
        _one(_mlp(), torch.randn(4, H), {"0.weight": "diagonal"})
