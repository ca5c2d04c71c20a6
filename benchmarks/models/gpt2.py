"""GPT-2-style decoder: token and position embeddings, pre-norm causal blocks, LM head.

Width 128, 6 blocks of 4 heads, context 64, batch 8, and a vocabulary of 8192: the untied
LM head (1M parameters) outweighs any block (about 200k), as in the real model where the
head and embeddings are the heaviest layers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks.models.attention import SelfAttention

VOCAB = 8192
WIDTH = 128
DEPTH = 6
HEADS = 4
CONTEXT = 64
BATCH = 8


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, causal=True)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    positions: Tensor

    def __init__(
        self,
        vocab: int = VOCAB,
        width: int = WIDTH,
        depth: int = DEPTH,
        heads: int = HEADS,
        context: int = CONTEXT,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.register_buffer("positions", torch.arange(context), persistent=False)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe(self.positions[: tokens.size(1)])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def model() -> nn.Module:
    torch.manual_seed(0)
    return GPT2()


def sample() -> Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (BATCH, CONTEXT), generator=generator)
