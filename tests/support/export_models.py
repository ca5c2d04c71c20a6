"""Models torch's pipeline() can trace, for the tests of the plan exports."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class MLP(nn.Module):
    """An input layer, a ModuleList of blocks and a head."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = (
            w(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, 2 * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """torchtitan's Llama in plain torch: ``tok_embeddings``, ``layers.N``, ``norm``,
    ``output``; its forward tolerates the modules torchtitan's splitter drops (``None``)."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, depth: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        # A ModuleDict, as torchtitan's: its splitter deletes the entries of other stages
        # and the rest keep their names.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads) for i in range(depth)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def stage_parameters(model: nn.Module, units: list[str]) -> set[str]:
    """The names of the parameters of the modules the units call (``a+b``: both)."""
    names = set()
    for unit in units:
        for label in unit.split("+"):
            path = label.partition("#")[0]
            names |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()}
    return names
