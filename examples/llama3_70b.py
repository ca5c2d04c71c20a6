"""A Llama-3-70B-shaped model on the meta device, for planning a cluster one does not have.

80 decoder blocks of hidden size 8192 (FFN 28672, 64 attention heads, 8 key/value heads),
a 128256-token vocabulary and an untied head, in bfloat16: about 70.6 billion parameters,
141 GB of weights alone. It is built on the meta device (no storage, nothing downloaded;
needs ``transformers``), so it loads in a second on any host; autopipe counts each block's
FLOPs and bytes on fake tensors and estimates its times for a catalog device::

    autopipe plan examples/llama3_70b.py --target h100 --stages 32 --chunks 64 \\
        --schedule 1f1b --optimizer adam-mixed

The sample is one mini-batch of 64 sequences of 4096 tokens (``--chunks 64``: micro-batches
of one sequence). ``adam-mixed`` counts float32 master weights and Adam state: 16 bytes per
parameter with the bfloat16 weight and gradient.
"""

from __future__ import annotations

import torch
import transformers

SEQUENCE = 4096
BATCH = 64


def llama(
    layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, positions: int = 8192
) -> torch.nn.Module:
    """A Llama-3-shaped causal LM on the meta device, in bfloat16, for sequences of up to
    ``positions`` tokens."""
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=128256,
        max_position_embeddings=positions,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def model() -> torch.nn.Module:
    """Llama-3-70B's shape."""
    return llama(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8)


def sample() -> torch.Tensor:
    """Token ids of one mini-batch (their values do not matter for planning)."""
    return torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
