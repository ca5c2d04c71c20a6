"""Mixtures of experts counted on fake tensors at an assumed routing, against real runs."""

from __future__ import annotations

import pytest
import torch

from profiler.count_pass import count_layers, expert_counts
from profiler.counting import count_layer, meta_copy
from profiler.measure import profile_layers
from tests.support.moe_models import (
    EXPERT_FFN,
    FAMILIES,
    HIDDEN,
    force_balanced,
    moe_block,
    real_counts,
)

CPU = torch.device("cpu")
# Per family: routed experts, and the routing weights' bytes (Mixtral's and DeepSeek-V3's
# routers give float32 weights, Qwen2-MoE's the model's dtype).
SHAPES = {"mixtral": (4, 4), "qwen2_moe": (4, 8), "deepseek_v3": (8, 4)}


def _sample(batch: int = 2, sequence: int = 6) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(batch, sequence, HIDDEN, dtype=torch.float64)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_balanced_assumption_counts_what_balanced_real_routing_computes(family: str) -> None:
    """The block (router, routed experts, shared experts) on real float64 tensors whose
    router is forced balanced, and on fake ones routed by the assumption: FLOPs of the
    forward, the backward, the input's gradient, and the saved bytes all equal."""
    block = moe_block(family)
    force_balanced(block)
    x = _sample()
    real = real_counts(block, (x,))
    counted, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU)
    assert (
        counted.flops,
        counted.backward_flops,
        counted.backward_input_flops,
        counted.saved,
    ) == real


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_grouped_path_counts_what_hugging_face_s_grouped_mm_keeps(family: str) -> None:
    """Hugging Face's default experts kernel where ``torch._grouped_mm`` runs (bfloat16
    here): the block on real tensors routed balanced and on fake ones routed by the
    assumption, FLOPs and saved bytes equal; it keeps less than the eager loop (no
    ``index_add_`` source)."""
    block = moe_block(family, torch.bfloat16, implementation="grouped_mm")
    force_balanced(block)
    x = _sample().to(torch.bfloat16)
    real = real_counts(block, (x,))
    counted, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU)
    found = (counted.flops, counted.backward_flops, counted.backward_input_flops, counted.saved)
    assert found == real
    eager = moe_block(family, torch.bfloat16)
    loop, _, _ = count_layer(meta_copy(eager), (x.to("meta"),), CPU)
    assert loop.flops == counted.flops
    assert loop.saved > counted.saved


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_traced_block_s_experts_are_counted_on_the_kernel_it_ran(family: str) -> None:
    """A trace keeps no experts module to read the kernel from: its grouped matmuls on
    the experts' weights tell it. Its figures are the module's grouped ones, but for the
    routing weights' dtype, which the trace does not see (it takes the experts')."""
    block = moe_block(family, torch.bfloat16, implementation="grouped_mm")
    x = _sample().to(torch.bfloat16)
    traced = torch.export.export(block, (x,)).module()
    found = [
        count_layer(meta_copy(layer), (x.to("meta"),), CPU)[0].experts
        for layer in (traced, block, moe_block(family, torch.bfloat16))
    ]
    assert all(f is not None for f in found)
    saved = [f.saved for f in found if f is not None]
    # Float32 routing weights where float64 blocks have them (4 bytes), else bfloat16.
    copies, weight_bytes = 12 * 2, 4 if SHAPES[family][1] == 4 else 2
    assert saved[0] == saved[1] - copies * (weight_bytes - 2)
    assert saved[2] > saved[1]  # the eager loop keeps more


def test_the_grouped_path_s_expert_figures_by_hand() -> None:
    """Hand-derived as below, for the grouped path: per copy the gathered hidden state,
    the up projection, the activation, the gated product, the down projection and the
    routing weight, and three indices (the gather's, the weights' and the inverse
    order's); each expert's offset (int32) once."""
    experts, weight_bytes = SHAPES["mixtral"]
    block = moe_block("mixtral", implementation="grouped_mm")
    counted, _, _ = count_layer(meta_copy(block), (_sample().to("meta"),), CPU)
    figures = counted.experts
    assert figures is not None
    copies, h, ffn = 12 * 2, HIDDEN, EXPERT_FFN
    flops = copies * 2 * (h * 2 * ffn + ffn * h)
    saved = copies * (3 * 8 + 8 * (h + 2 * ffn + ffn + ffn + h) + weight_bytes) + experts * 4
    assert (figures.flops, figures.backward_flops, figures.backward_input_flops) == (
        flops,
        2 * flops,
        flops,
    )
    assert figures.saved == saved


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_expert_figures_are_those_of_the_routed_experts_alone(family: str) -> None:
    """Hand-derived: 12 tokens, top-2, hidden 16, expert FFN 16, float64."""
    experts, weight_bytes = SHAPES[family]
    block = moe_block(family)
    x = _sample()
    counted, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU)
    figures = counted.experts
    assert figures is not None
    copies, h, ffn = 12 * 2, HIDDEN, EXPERT_FFN
    # Each copy: up (h -> 2 ffn) and down (ffn -> h) projections, a multiply-add twice.
    flops = copies * 2 * (h * 2 * ffn + ffn * h)
    # Saved per copy: its token and top-k positions (int64), the gathered hidden state, the
    # up projection, the activation, the gated product, the down projection, the weighted
    # output (index_add_ keeps its source), and the routing weight.
    saved = copies * (2 * 8 + 8 * (h + 2 * ffn + ffn + ffn + h + h) + weight_bytes)
    assert (figures.experts, figures.top_k, figures.blocks) == (experts, 2, 1)
    assert figures.param_bytes == experts * (2 * ffn * h + h * ffn) * 8
    assert (figures.flops, figures.backward_flops, figures.backward_input_flops) == (
        flops,
        2 * flops,
        flops,
    )
    assert figures.saved == saved
    assert figures.dispatch_bytes == copies * h * 8
    assert figures.skew == 1.0
    assert counted.flops > figures.flops  # the router (and shared experts) besides


@pytest.mark.parametrize(
    ("family", "groups"), [("mixtral", (1, 1)), ("qwen2_moe", (1, 1)), ("deepseek_v3", (2, 1))]
)
def test_group_limited_routing_is_read_from_the_router(
    family: str, groups: tuple[int, int]
) -> None:
    """DeepSeek-V3's router picks ``topk_group`` of ``n_group`` groups before its experts
    (the small model: 1 of 2); the others have no group limit."""
    block = moe_block(family)
    counted, _, _ = count_layer(meta_copy(block), (_sample().to("meta"),), CPU)
    assert counted.experts is not None
    assert (counted.experts.groups, counted.experts.top_groups) == groups


def _counted_experts(
    family: str, experts: int, tokens: int, implementation: str
) -> tuple[float, ...]:
    """``(weight traffic, backward weight traffic, row traffic, backward row traffic,
    the layer's backward traffic)`` of ``family``'s block with ``experts`` experts."""
    names = {"mixtral": "num_local_experts", "qwen2_moe": "num_experts"}
    build, index = FAMILIES[family]
    model = build(**{names.get(family, "n_routed_experts"): experts})
    model.set_experts_implementation(implementation)
    block = model.model.layers[index].mlp.to(torch.float64)
    x = torch.zeros(1, tokens, HIDDEN, dtype=torch.float64, device="meta")
    counted, _, _ = count_layer(meta_copy(block), (x,), CPU)
    found = counted.experts
    assert found is not None and found.traffic is not None
    assert found.weight_traffic is not None and found.backward_traffic is not None
    assert found.backward_weight_traffic is not None
    return (
        found.weight_traffic,
        found.backward_weight_traffic,
        found.traffic - found.weight_traffic,
        found.backward_traffic - found.backward_weight_traffic,
        counted.backward_traffic,
    )


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_experts_traffic_is_a_grouped_kernel_s(family: str, implementation: str) -> None:
    """Each expert on its own rows and weights: what follows the tokens doubles with
    them and does not grow with the experts; what does not (the weights) grows with the
    experts, not the tokens (the backward moves each weight byte 6 times: read, its
    gradient written, sliced out and accumulated). The eager loop's full-tensor copies
    per expert are gone from the layer's backward: 8 times the experts add their weights'
    traffic and a router 8 times wider (under twice the weights'), not a copy of the whole
    stack per expert (about 16 times)."""
    few = _counted_experts(family, 8, 256, implementation)
    many = _counted_experts(family, 64, 256, implementation)
    longer = _counted_experts(family, 8, 512, implementation)
    assert few[2:4] == many[2:4]
    assert longer[2:4] == (2 * few[2], 2 * few[3])
    assert longer[:2] == few[:2]
    assert many[1] == 8 * few[1]
    weights = 8 * 3 * EXPERT_FFN * HIDDEN * 8  # 8 experts' up, gate and down, float64
    assert few[1] == 6 * weights
    assert many[4] - few[4] < 2 * (many[1] - few[1])


def test_skew_keeps_the_routed_flops_and_records_the_assumption() -> None:
    block = moe_block("mixtral")
    x = _sample(batch=4, sequence=8)  # 32 tokens, 64 copies, mean 16 per expert
    balanced, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU)
    skewed, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU, skew=2.5)
    assert balanced.experts is not None and skewed.experts is not None
    assert skewed.experts.skew == 2.5
    assert skewed.experts.flops == balanced.experts.flops
    assert skewed.experts.backward_flops == balanced.experts.backward_flops
    assert skewed.flops == balanced.flops


def test_layers_without_experts_have_none_and_each_batch_size_has_its_figures() -> None:
    block = moe_block("qwen2_moe")
    dense = torch.nn.Linear(HIDDEN, HIDDEN).double()
    inputs = [(torch.empty(b, 6, HIDDEN, dtype=torch.float64, device="meta"),) for b in (1, 2)]
    counted = count_layers([dense, block], inputs, ["dense", "moe"], CPU, skew=1.5)
    assert expert_counts(counted[0].counts) is None
    found = expert_counts(counted[1].counts)
    assert found is not None
    assert found.dispatch_bytes == [6 * 2 * HIDDEN * 8, 12 * 2 * HIDDEN * 8]
    assert found.flops[1] == 2 * found.flops[0]
    assert found.skew == 1.5
    found.check("moe", 2)


def test_a_measured_profile_carries_the_counted_experts() -> None:
    block = moe_block("deepseek_v3")
    profile = profile_layers(
        [block], _sample(), batch_sizes=[2], warmup=0, repeats=1, pool=False, expert_skew=2.0
    )
    experts = profile.layers[0].experts
    assert experts is not None
    assert (experts.experts, experts.top_k, experts.skew) == (8, 2, 2.0)
    assert profile.layers[0].forward[0] > 0  # measured, not only counted


def test_a_bad_skew_is_refused_before_profiling() -> None:
    with pytest.raises(ValueError, match="expert_skew must be a finite number >= 1"):
        profile_layers([moe_block("mixtral")], _sample(), measure=False, expert_skew=0.5)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_gpt_oss_experts_with_biases_and_their_own_gate_count_as_they_run(
    implementation: str,
) -> None:
    """GPT-OSS's experts: transposed weights, biases, a clamped gate of their own (its
    router gives logits, scores and indices, as Mixtral's does)."""
    import transformers

    config = transformers.GptOssConfig(
        hidden_size=HIDDEN, intermediate_size=EXPERT_FFN, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=50, head_dim=4, layer_types=["full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    model.set_experts_implementation(implementation)
    block = model.model.layers[0].mlp
    force_balanced(block, block.router)
    x = _sample().to(torch.bfloat16)
    counted, _, _ = count_layer(meta_copy(block), (x.to("meta"),), CPU)
    found = (counted.flops, counted.backward_flops, counted.backward_input_flops, counted.saved)
    assert found == real_counts(block, (x,))
