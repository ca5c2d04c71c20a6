"""Tests of profiler.op_flops: one operation's FLOPs, the CPU's fused attention included."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from profiler.op_flops import CPU_ATTENTION_FLOPS, op_flops

aten = torch.ops.aten


def test_a_matmul_counts_two_flops_per_multiply_add() -> None:
    a, b = torch.ones(3, 4), torch.ones(4, 5)
    assert op_flops(aten.mm.default, (a, b), {}, a @ b) == 2 * 3 * 4 * 5


def test_the_cpu_attention_kernel_counts_as_the_cuda_ones() -> None:
    q = k = v = torch.ones(1, 2, 8, 4)
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    func = aten._scaled_dot_product_flash_attention_for_cpu.default
    expected = sdpa_flop_count(q.shape, k.shape, v.shape)
    assert expected > 0
    assert op_flops(func, (q, k, v), {}, out) == expected
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert counter.get_total_flops() == expected


def test_an_operation_the_counter_does_not_know_counts_nothing() -> None:
    x = torch.ones(3)
    assert op_flops(aten.relu.default, (x,), {}, x) == 0


def test_a_grouped_gemm_counts_as_one_matmul_per_group() -> None:
    """Forward and backward (input and weight gradients) of torch._grouped_mm, the kernel
    of Hugging Face's routed experts, count as the per-group matmuls on their rows."""
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    offsets = torch.tensor([5, 8, 12], dtype=torch.int32)
    loop = FlopCounterMode(display=False)
    with loop:
        starts = [0, 5, 8]
        for g, (start, end) in enumerate(zip(starts, offsets.tolist(), strict=True)):
            (x[start:end] @ w[g]).backward(torch.ones(end - start, 16))
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as forward:
        out = torch._grouped_mm(x, w, offs=offsets)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as backward:
        out.backward(torch.ones_like(out))
    assert forward.get_total_flops() == 2 * 12 * 8 * 16
    assert forward.get_total_flops() + backward.get_total_flops() == loop.get_total_flops()
