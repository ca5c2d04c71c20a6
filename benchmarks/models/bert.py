"""BERT-style encoder: embeddings, post-norm bidirectional blocks, pooler and classifier.

Vocabulary 4096, width 128, 4 blocks of 4 heads, sequences of 64 in batches of 8. The
sample is ``(input_ids, token_type_ids, attention_mask)``; padded positions (mask 0) are
hidden from attention by an additive mask.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks.models.attention import SelfAttention

VOCAB = 4096
WIDTH = 128
DEPTH = 4
HEADS = 4
LENGTH = 64
BATCH = 8
CLASSES = 2


class EncoderBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = SelfAttention(width, heads)
        self.ln1 = nn.LayerNorm(width)
        self.ffn = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.ln2 = nn.LayerNorm(width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = self.ln1(x + self.attn(x, bias))
        return self.ln2(x + self.ffn(x))


class Embeddings(nn.Module):
    positions: Tensor

    def __init__(self, vocab: int, width: int, length: int) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, width)
        self.position = nn.Embedding(length, width)
        self.token_type = nn.Embedding(2, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("positions", torch.arange(length), persistent=False)

    def forward(self, ids: Tensor, types: Tensor) -> Tensor:
        x = self.words(ids) + self.token_type(types)
        return self.norm(x + self.position(self.positions[: ids.size(1)]))


class Bert(nn.Module):
    def __init__(
        self,
        vocab: int = VOCAB,
        width: int = WIDTH,
        depth: int = DEPTH,
        heads: int = HEADS,
        length: int = LENGTH,
        classes: int = CLASSES,
    ) -> None:
        super().__init__()
        self.embeddings = Embeddings(vocab, width, length)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads) for _ in range(depth))
        self.pooler = nn.Sequential(nn.Linear(width, width), nn.Tanh())
        self.classifier = nn.Linear(width, classes)

    def forward(self, ids: Tensor, types: Tensor, mask: Tensor) -> Tensor:
        # (batch, 1, 1, length): 0 where attended, a large negative number where padded.
        bias = (1.0 - mask[:, None, None, :].float()) * -1e4
        x = self.embeddings(ids, types)
        for block in self.blocks:
            x = block(x, bias)
        return self.classifier(self.pooler(x[:, 0]))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Bert()


def sample() -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(VOCAB, (BATCH, LENGTH), generator=generator)
    types = (torch.arange(LENGTH) >= LENGTH // 2).long().expand(BATCH, LENGTH).contiguous()
    lengths = torch.randint(LENGTH // 2, LENGTH + 1, (BATCH, 1), generator=generator)
    mask = (torch.arange(LENGTH) < lengths).long()
    return ids, types, mask
