"""Multi-head self-attention shared by the transformer models of the zoo."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SelfAttention(nn.Module):
    """Self-attention over ``(batch, length, width)``; causal, or with an additive mask."""

    def __init__(self, width: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=self.causal)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))
