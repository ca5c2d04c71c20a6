"""A Mixtral-8x7B-shaped mixture of experts on the meta device, for planning without GPUs.

32 decoder blocks of hidden size 4096 (32 attention heads, 8 key/value heads), each with a
sparse mixture of 8 experts of FFN 14336 of which every token uses 2, a 32000-token
vocabulary, in bfloat16: about 46.7 billion parameters, 12.9 billion of them active per
token. Built on the meta device (no storage, nothing downloaded; needs ``transformers``);
autopipe counts each block on fake tensors, its router's tokens routed by an assumption
(balanced top-2 by default, ``--expert-skew S`` for a busiest expert with S times the
mean), and estimates its times for a catalog device::

    autopipe plan examples/mixtral_8x7b.py --target h100 --stages 16 --chunks 32 \\
        --schedule 1f1b --optimizer adam-mixed

The sample is one mini-batch of 32 sequences of 4096 tokens.
"""

from __future__ import annotations

import torch
import transformers

SEQUENCE = 4096
BATCH = 32


def model() -> torch.nn.Module:
    """Mixtral-8x7B's shape."""
    config = transformers.MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=32000,
        max_position_embeddings=32768,
        rope_theta=1e6,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config).to(torch.bfloat16)


def sample() -> torch.Tensor:
    """Token ids of one mini-batch (their values do not matter for planning)."""
    return torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
