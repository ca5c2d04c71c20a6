"""Small Hugging Face mixtures of experts, their routing forced, counted on real tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from profiler.layer import Pass, state_storages
from profiler.op_flops import CPU_ATTENTION_FLOPS

__all__ = [
    "FAMILIES",
    "deepseek_v3",
    "force_balanced",
    "mixtral",
    "moe_block",
    "qwen2_moe",
    "real_counts",
]

HIDDEN, EXPERT_FFN = 16, 16  # rows of 16 bytes in bfloat16, as the grouped GEMM needs


def mixtral(**config: Any) -> nn.Module:
    """A small Mixtral: 4 experts, top-2, no shared expert."""
    import transformers

    settings: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "intermediate_size": EXPERT_FFN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 50,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**settings, **config}))


def qwen2_moe(**config: Any) -> nn.Module:
    """A small Qwen2-MoE: 4 experts, top-2, a gated shared expert."""
    import transformers

    settings: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "intermediate_size": 24,
        "moe_intermediate_size": EXPERT_FFN,
        "shared_expert_intermediate_size": 20,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 50,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**settings, **config}))


def deepseek_v3(**config: Any) -> nn.Module:
    """A small DeepSeek-V3: MLA attention, a dense first layer, then 8 routed experts (top-2
    of 2 groups) and a shared expert."""
    import transformers

    settings: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "intermediate_size": 24,
        "moe_intermediate_size": EXPERT_FFN,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 12,
        "kv_lora_rank": 8,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 4,
        "v_head_dim": 4,
        "vocab_size": 50,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    return transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**settings, **config})
    )


# name -> (build, index of a decoder layer with routed experts)
FAMILIES: dict[str, tuple[Callable[..., nn.Module], int]] = {
    "mixtral": (mixtral, 0),
    "qwen2_moe": (qwen2_moe, 0),
    "deepseek_v3": (deepseek_v3, 1),
}


def moe_block(
    family: str,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    implementation: str = "eager",
) -> nn.Module:
    """The sparse mixture-of-experts block of one layer of a small ``family`` model, its
    experts running Hugging Face's ``implementation`` (eager: the per-expert loop)."""
    build, layer = FAMILIES[family]
    torch.manual_seed(seed)
    model = build().to(dtype)
    model.set_experts_implementation(implementation)
    block: nn.Module = model.model.layers[layer].mlp
    return block


def force_balanced(block: nn.Module, router: nn.Module | None = None) -> Callable[[], None]:
    """Makes the block's router (``block.gate`` unless given) send token ``t``'s ``j``-th
    choice to expert ``(t * k + j) % E``: every expert receives ``tokens * k / E`` tokens
    (the remainder one more each for the first experts), whatever the values. The router
    still runs all its operations; only the chosen indices change. Returns the undo."""
    gate = block.gate if router is None else router

    def hook(module: nn.Module, inputs: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
        logits, weights, index = output
        tokens, top_k = index.shape
        experts = logits.shape[-1]
        order = torch.arange(tokens * top_k, device=index.device).view(tokens, top_k)
        return logits, weights, (order % experts).to(index.dtype)

    handle = gate.register_forward_hook(hook)
    return handle.remove


def real_counts(layer: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[float, float, float, int]:
    """FLOPs of the forward, the backward and the input's gradient, and the saved bytes, of
    ``layer`` run on real tensors, counted as :func:`profiler.counting.count_layer` counts
    them on fake ones."""
    device = torch.device("cpu")
    runs = Pass(layer, inputs, device, "the layer")
    saved = runs.saved(state_storages(layer)).total
    forward, backward, input_only = (
        FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) for _ in range(3)
    )
    args = runs.arguments()
    with forward:
        targets = runs.forward(args)
    with backward:
        runs.backward(targets)
    args = runs.arguments()
    targets = runs.forward(args)
    with input_only:
        torch.autograd.grad(targets, list(args), runs.grads, allow_unused=True)
    flops = [float(c.get_total_flops()) for c in (forward, backward, input_only)]
    return flops[0], flops[1], min(flops[2], flops[1]), saved
