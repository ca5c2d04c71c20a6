"""Models whose modules return tuples, dicts or dataclasses that the model then unpacks."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

__all__ = [
    "AttentionStack",
    "DataclassBlock",
    "DataclassBlocks",
    "DictBlock",
    "DictBlocks",
    "GRUStack",
    "LSTMStack",
    "NestedLSTM",
    "StateBlock",
    "StateSkip",
]


class LSTMStack(nn.Module):
    """Three stacked LSTMs and a linear head."""

    def __init__(self, features: int = 4, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.lstm1 = nn.LSTM(features, hidden, batch_first=True)
        self.lstm2 = nn.LSTM(hidden, hidden, batch_first=True)
        self.lstm3 = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        x, _ = self.lstm1(x)
        x, _ = self.lstm2(x)
        x, _ = self.lstm3(x)
        return self.head(x)


class GRUStack(nn.Module):
    """Two stacked GRUs and a linear head reading the last step of the second."""

    def __init__(self, features: int = 4, hidden: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.gru1 = nn.GRU(features, hidden, batch_first=True)
        self.gru2 = nn.GRU(hidden, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        x, _ = self.gru1(x)
        x, _ = self.gru2(x)
        return self.head(x[:, -1])


class NestedLSTM(nn.Module):
    """An LSTM whose final hidden state, from its nested ``(out, (h, c))`` result, is used
    after the next layer."""

    def __init__(self, features: int = 4, hidden: int = 6) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True)
        self.mid = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        out, (h, _) = self.lstm(x)
        y = self.mid(out)
        return self.head(y + h.transpose(0, 1))


class AttentionStack(nn.Module):
    """Self-attention blocks returning ``(out, weights)``; the weights are never used."""

    def __init__(self, width: int = 8, heads: int = 2, depth: int = 3) -> None:
        super().__init__()
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(width, heads, batch_first=True) for _ in range(depth)
        )
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        for attn in self.attns:
            out, _ = attn(x, x, x)
            x = x + out
        return self.head(x)


class StateBlock(nn.Module):
    """A block returning its output and a state."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.inner(x).tanh()
        return y, self.gate(y).sigmoid()


class StateSkip(nn.Module):
    """Blocks returning ``(out, state)``; the first block's state is used two blocks later."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(StateBlock(width) for _ in range(4))
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        x, skip = self.blocks[0](x)
        x, _ = self.blocks[1](x)
        x, state = self.blocks[2](x + skip)
        x, _ = self.blocks[3](x * state)
        return self.head(x)


class DictBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: Tensor) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
        y = self.inner(x)
        return {"hidden": y.relu(), "extra": (y.sin(), y.cos())}


class DictBlocks(nn.Module):
    """Blocks returning a dict holding a nested tuple; ``extra[1]`` of one block is used by
    the block after next."""

    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DictBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        carried = x
        for k, block in enumerate(self.blocks):
            out = block(x if k % 2 == 0 else x + carried)
            x, carried = out["hidden"], out["extra"][1]
        return self.head(x)


@dataclass
class BlockOutput:
    """A Hugging Face ``ModelOutput``-style result."""

    last_hidden_state: Tensor
    attentions: Tensor | None = None


class DataclassBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: Tensor) -> BlockOutput:
        y = self.inner(x)
        return BlockOutput(y.tanh(), y.softmax(-1))


class DataclassBlocks(nn.Module):
    """Blocks returning a dataclass, read by attribute; ``attentions`` goes unused."""

    def __init__(self, width: int = 6, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DataclassBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x).last_hidden_state
        return self.head(x)
