"""Models built on the meta device and for real, to compare what autopipe makes of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SMALL_GPT2",
    "SMALL_LLAMA",
    "ItemGate",
    "MaskedPick",
    "build",
    "gpt2",
    "llama",
    "load_from",
    "small_cnn",
    "token_ids",
]

SMALL_GPT2: dict[str, Any] = {
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "vocab_size": 50,
    "n_positions": 16,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
SMALL_LLAMA: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
    "max_position_embeddings": 32,
}


def build(factory: Callable[[], nn.Module], meta: bool, seed: int = 0) -> nn.Module:
    """The model ``factory`` makes, on the meta device or for real (seeded)."""
    if meta:
        with torch.device("meta"):
            return factory()
    torch.manual_seed(seed)
    return factory()


def gpt2(**config: Any) -> nn.Module:
    """A small Hugging Face GPT-2 language model (its head tied to the embedding)."""
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**SMALL_GPT2, **config}))


def llama(**config: Any) -> nn.Module:
    """A small Hugging Face Llama language model with its default settings."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL_LLAMA, **config}))


def small_cnn() -> nn.Module:
    """Convolutions with batch norm, then a linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
    )


def token_ids(batch: int = 4, length: int = 8, vocab: int = 50, seed: int = 1) -> Tensor:
    """Random token ids on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator)


class ItemGate(nn.Module):
    """Reads a tensor's value in Python (``.item()``): needs values even under export."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.a.weight.abs().sum().item()
        return self.b(self.a(x) * scale)


class MaskedPick(nn.Module):
    """Keeps the features a mask buffer selects (``torch.nonzero``: a size from values)."""

    mask: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("mask", torch.tensor([True, False, True, True]))
        self.b = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        keep = torch.nonzero(self.mask).flatten()
        return self.b(self.a(x).index_select(1, keep))


def load_from(state: dict[str, Tensor]) -> Callable[[nn.Module], None]:
    """An ``init=`` hook that loads a part's tensors from a saved state_dict by name."""

    def init(part: nn.Module) -> None:
        wanted = part.state_dict(keep_vars=True)
        missing = sorted(set(wanted) - set(state))
        assert not missing, f"the checkpoint lacks {missing}"
        part.load_state_dict({name: state[name] for name in wanted})

    return init
