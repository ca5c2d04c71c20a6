"""A GPT-2-shaped Hugging Face model, for ``autopipe plan examples/gpt2.py --stages 4``.

Built from a config with random weights (nothing is downloaded); needs ``transformers``.
It is not an ``nn.Sequential``: autopipe traces it (with transformers 5 torch.fx cannot,
so torch.export does, in non-strict mode) and cuts it between its blocks (the token and
position embeddings, each transformer block, the final norm and the LM head).
"""

import torch
import transformers


def model() -> torch.nn.Module:
    """A 12-block GPT-2 of width 256 (about 7M parameters besides the embeddings)."""
    config = transformers.GPT2Config(
        n_layer=12,
        n_head=8,
        n_embd=256,
        vocab_size=8192,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    config._attn_implementation = "eager"  # plain attention ops, which torch.export traces
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def sample() -> torch.Tensor:
    """A mini-batch of 16 sequences of 128 token ids."""
    return torch.randint(0, 8192, (16, 128), generator=torch.Generator().manual_seed(0))
