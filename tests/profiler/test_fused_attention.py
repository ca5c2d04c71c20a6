"""Attention with values narrower than its queries: counted as the fused kernel runs it
(profiler.fused_attention), computing what the plain call computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from profiler import profile_layers
from profiler.fused_attention import FusedAttention

HEADS, TOKENS, WIDTH, NARROW = 4, 256, 24, 16


class _Attention(nn.Module):
    """Queries and keys of ``WIDTH`` and values of ``NARROW`` from one input, per head."""

    def __init__(self, narrow: int = NARROW) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 2 * HEADS * WIDTH, bias=False)
        self.v = nn.Linear(8, HEADS * narrow, bias=False)
        self.narrow = narrow

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k = self.qk(x).view(b, s, 2, HEADS, WIDTH).permute(2, 0, 3, 1, 4)
        v = self.v(x).view(b, s, HEADS, self.narrow).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_padded_values_compute_what_the_plain_call_computes() -> None:
    torch.manual_seed(0)
    layer = _Attention().double()
    x = torch.randn(2, TOKENS, 8, dtype=torch.float64)
    plain = layer(x)
    (plain_grad,) = torch.autograd.grad(plain.sum(), layer.v.weight)
    with FusedAttention():
        fused = layer(x)
    (fused_grad,) = torch.autograd.grad(fused.sum(), layer.v.weight)
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-12, atol=1e-12)


def test_no_score_matrix_is_saved_and_the_values_count_at_the_padded_width() -> None:
    x = torch.randn(1, TOKENS, 8)
    (narrow,) = profile_layers([_Attention()], x, batch_sizes=[1], measure=False).layers
    (wide,) = profile_layers([_Attention(WIDTH)], x, batch_sizes=[1], measure=False).layers
    scores = HEADS * TOKENS * TOKENS * 4  # one float32 s × s matrix per head
    assert narrow.saved[0] < scores  # the math path saves its probabilities
    # The fused kernel's products at the queries' width, as for values that wide; the
    # value projection is the narrower one.
    projection = 2 * TOKENS * 8 * HEADS * (WIDTH - NARROW)
    assert narrow.flops is not None and wide.flops is not None
    assert narrow.flops[0] == wide.flops[0] - projection
