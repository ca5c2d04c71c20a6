"""A small Hugging Face Llama with an untied 16k-vocabulary head that outweighs its blocks.

Built from a ``transformers.LlamaConfig`` with random weights (nothing is downloaded).
The LM head (width 128 to 16,384 logits per token) is not tied to the embedding, so it is
a unit of its own whose cost exceeds several transformer blocks: the split that balances
the stages gives the head's stage fewer blocks. Not in the zoo (it needs ``transformers``);
used by ``benchmarks.balance.bench_suite`` as a model file.
"""

from __future__ import annotations

import torch
import transformers
from torch import Tensor, nn

VOCAB = 16384
WIDTH = 128
BLOCKS = 6
BATCH = 8
CONTEXT = 64


def model() -> nn.Module:
    """The Llama: 6 blocks of width 128, 4 heads, an untied 16,384-token head."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=4 * WIDTH,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "eager"  # plain attention ops, which torch.export traces
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def sample() -> Tensor:
    """A mini-batch of 8 sequences of 64 token ids."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(VOCAB, (BATCH, CONTEXT), generator=generator)
