"""Small models that exercise ``autopipe.wrap``: skips, attention, dropout, batch norm, kwargs."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DataDependent",
    "DropoutBatchNorm",
    "GradRegion",
    "KeywordModel",
    "MaskedBlocks",
    "ResidualMLP",
    "ShapeLoop",
    "SharedBias",
    "SizeAtRoot",
    "SplitJoin",
    "TiedEnds",
    "TiedPair",
    "TinyGPT",
    "UNet",
]


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    """Linear in, residual blocks, linear out."""

    def __init__(self, width: int = 8, depth: int = 4, classes: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class CausalSelfAttention(nn.Module):
    mask: Tensor

    def __init__(self, width: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, context, context), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = F.dropout(att.softmax(dim=-1), self.dropout, self.training)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class GPTBlock(nn.Module):
    def __init__(self, width: int, heads: int, context: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, context, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token + position embedding, causal attention, tied LM head."""

    def __init__(
        self,
        vocab: int = 32,
        width: int = 16,
        heads: int = 2,
        depth: int = 3,
        context: int = 8,
        dropout: float = 0.0,
        tied: bool = True,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(width, heads, context, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class UNet(nn.Module):
    """A small U-Net: every encoder output skips to its decoder level."""

    def __init__(self, channels: int = 3, width: int = 4, levels: int = 3) -> None:
        super().__init__()
        sizes = [width * 2**i for i in range(levels)]
        self.down = nn.ModuleList(
            ConvBlock(cin, cout) for cin, cout in zip([channels, *sizes[:-1]], sizes)
        )
        self.mid = ConvBlock(sizes[-1], sizes[-1])
        self.up = nn.ModuleList(ConvBlock(2 * s, s) for s in reversed(sizes))
        self.ups = nn.ModuleList(
            nn.ConvTranspose2d(a, b, 2, stride=2)
            for a, b in zip([sizes[-1], *reversed(sizes[1:])], reversed(sizes))
        )
        self.head = nn.Conv2d(sizes[0], 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, block, skip in zip(self.ups, self.up, reversed(skips)):
            x = block(torch.cat([up(x), skip], dim=1))
        return self.head(x)


class DropoutBatchNorm(nn.Module):
    """Linear layers with batch norm, in-place ReLU, dropout (module and functional)."""

    def __init__(self, width: int = 8, p: float = 0.0) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(inplace=True))
            for _ in range(3)
        )
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, 2)
        self.register_buffer("scale", torch.full((width,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        x = self.layers[0](x)
        x = self.drop(x)
        x = self.layers[1](x)
        x = F.dropout(x, self.p, self.training)
        x = self.layers[2](x) * self.scale
        x.add_(1.0)
        return self.head(x)


_OFFSET = torch.linspace(-1.0, 1.0, 6)  # a global tensor: fx makes it a graph constant


class KeywordModel(nn.Module):
    """Keyword tensor inputs, baked constants, and a dict output holding a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 6)
        self.mix = nn.Linear(6, 6)
        self.dec = nn.Linear(6, 2)

    def forward(
        self, x: Tensor, *, mask: Tensor, scale: float = 1.0, extra: Tensor | None = None
    ) -> dict[str, object]:
        h = self.enc(x) * mask.unsqueeze(-1) * scale
        if extra is not None:
            h = h + extra
        g = torch.tanh(self.mix(h) + _OFFSET)
        return {"logits": self.dec(g), "hidden": (h, g), "scale": scale}


class LoopBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        # Python control flow on a shape: torch.fx cannot trace it, torch.export can.
        for i in range(x.shape[1]):
            x = x + self.proj(x)[:, i : i + 1] / (i + 1)
        return x


class ShapeLoop(nn.Module):
    """A model torch.fx cannot trace but torch.export (non-strict) can."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LoopBlock(width) for _ in range(3))
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        # A tensor made in forward: export lifts it into a constant of the graph.
        return self.head(x) * torch.tensor([1.0, -1.0])


class Gate(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:  # data-dependent: neither fx nor export can trace it
            return x * 2
        return -x


class DataDependent(nn.Module):
    """A model that only traces with ``leaf_modules=["gate"]``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.gate(self.a(x)))


class Split(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return x.chunk(2, dim=-1)


class Join(nn.Module):
    def forward(self, parts: tuple[Tensor, ...]) -> Tensor:
        return torch.cat([parts[1], parts[0]], dim=-1)


class SplitJoin(nn.Module):
    """A module passing a tuple to the next one: that boundary cannot be cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.split = Split()
        self.join = Join()
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.join(self.split(self.a(x))))


class TiedPair(nn.Module):
    """Two consecutive layers sharing one weight, between two independent ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.last = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.last(self.b(torch.relu(self.a(self.first(x)))))


class TiedEnds(nn.Module):
    """The first and last layers share a weight, with two layers in between."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mid1 = nn.Linear(4, 4)
        self.mid2 = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)
        self.last.weight = self.first.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.last(torch.tanh(self.mid2(torch.tanh(self.mid1(self.first(x))))))


class _BiasedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        return torch.tanh(self.fc(x) + bias)


class SharedBias(nn.Module):
    """Blocks that each add one learned bias of the model, an ``nn.Parameter`` of no module
    of theirs (the model passes it to every block, as DeBERTa its relative embeddings).
    With ``clamp`` the model also clamps the bias in place before each block."""

    def __init__(self, width: int = 8, depth: int = 4, clamp: bool = False) -> None:
        super().__init__()
        self.clamp = clamp
        self.bias = nn.Parameter(torch.randn(width))
        self.blocks = nn.ModuleList(_BiasedBlock(width) for _ in range(depth))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.clamp:
                with torch.no_grad():
                    self.bias.clamp_(-1.0, 1.0)
            x = block(x, self.bias)
        return x


class SizeAtRoot(nn.Module):
    """Reads the batch size once at the top and uses it after the last layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        return self.c(self.b(self.a(x))).reshape(n, 2, 3)


class MaskedBlocks(nn.Module):
    """Blocks reading one buffer of the model; ``count=True`` also writes another."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.count = count
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.register_buffer("mask", torch.tensor([1.0, 0.0, 1.0, 1.0]))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x) * self.mask
            if self.count:
                self.calls.add_(1)
        return x


GRAD_FORMS = ("no_grad", "set_grad_enabled", "inference_mode", "enable_grad")


class GradRegion(nn.Module):
    """Four layers (units stem, a, b, c), the first ones under a grad-mode manager.

    ``no_grad``, ``set_grad_enabled`` (False) and ``inference_mode`` freeze the stem, and
    with ``span`` a and b too: a region across the middle cut. ``enable_grad`` computes a
    (and b with ``span``) with gradients inside a no_grad block around the stem.
    """

    def __init__(self, form: str, span: bool = False) -> None:
        super().__init__()
        self.form = form
        self.span = span
        self.stem = nn.Linear(4, 6)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)

    def _region(self) -> Any:
        if self.form == "no_grad":
            return torch.no_grad()
        if self.form == "set_grad_enabled":
            return torch.set_grad_enabled(False)
        return torch.inference_mode()

    def forward(self, x: Tensor) -> Tensor:
        if self.form == "enable_grad":
            with torch.no_grad():
                h = self.stem(x)
                with torch.enable_grad():
                    h = self.a(h)
                    if self.span:
                        h = self.b(h)
            return self.c(h if self.span else self.b(h))
        with self._region():
            h = self.stem(x)
            if self.span:
                h = self.b(self.a(h))
        h = h.clone()  # a normal tensor again after inference_mode
        return self.c(h if self.span else self.b(self.a(h)))
