"""A DeepSeek-V3-shaped mixture of experts on the meta device, for planning without GPUs.

61 decoder blocks of hidden size 7168 with multi-head latent attention (128 heads, query
rank 1536, key/value rank 512, 128 + 64 rotary dimensions per query/key head, 128 per
value head); the first 3 blocks have a dense FFN of 18432, the other 58 a mixture of 256
routed experts of FFN 2048 (each token uses 8) beside 1 shared expert; a 129280-token
vocabulary, in bfloat16: about 671 billion parameters. Built on the meta device (no
storage, nothing downloaded; needs ``transformers``); autopipe counts each distinct block
once on fake tensors, its router's tokens routed by an assumption (balanced top-8 by
default, ``--expert-skew S`` for a busiest expert with S times the mean)::

    autopipe plan examples/deepseek_v3.py --target h100 --stages 16 --chunks 16

The sample is one mini-batch of 16 sequences of 4096 tokens. Pipeline stages alone cannot
hold it: one block's routed experts are 22.5 GB of bfloat16 weights, several times that
with their gradients and Adam state, more than an H100 has; the plan says by how much.
Expert parallelism divides them (``LayerProfile.experts``, docs/giant-models.md).
"""

from __future__ import annotations

import torch
import transformers

SEQUENCE = 4096
BATCH = 16


def model() -> torch.nn.Module:
    """DeepSeek-V3's shape."""
    config = transformers.DeepseekV3Config(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        num_key_value_heads=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=129280,
        max_position_embeddings=SEQUENCE,
        use_cache=False,
    )
    with torch.device("meta"):
        return transformers.DeepseekV3ForCausalLM(config).to(torch.bfloat16)


def sample() -> torch.Tensor:
    """Token ids of one mini-batch (their values do not matter for planning)."""
    return torch.zeros(BATCH, SEQUENCE, dtype=torch.long)
