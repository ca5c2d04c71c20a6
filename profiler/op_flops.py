"""One operation's FLOPs as torch's flop counter counts them, with the CPU's fused attention
and the grouped GEMM.

torch's flop counter knows the CUDA kernels of ``scaled_dot_product_attention`` but not the
CPU's flash kernel, which is what a model traced on fake tensors on the CPU dispatches to;
without it a counted profile would miss attention's FLOPs, which grow with the square of
the sequence. They are counted here as the CUDA kernels are. Nor does it know
``torch._grouped_mm``, the kernel of Hugging Face's routed experts (one matmul per expert
on its share of the rows): counted here as those matmuls, whatever the shares.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

__all__: list[str] = []

aten = torch.ops.aten

ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
}
ATTENTION_BACKWARD = {
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
}


def _cpu_attention_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return int(sdpa_flop_count(query.shape, key.shape, value.shape))


def _cpu_attention_backward_flops(
    grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
) -> int:
    return int(sdpa_backward_flop_count(grad.shape, query.shape, key.shape, value.shape))


def _grouped_mm_flops(a: Any, b: Any, *args: Any, **kwargs: Any) -> int:
    """A grouped GEMM's multiply-adds, twice: ``(rows, k) x (groups, k, n)`` multiplies
    each row once (``2 * rows * k * n``); ``(k, rows) x (rows, n)`` (a weight's
    gradient) sums each group's rows into its own ``(k, n)``, as many products."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * int(a.shape[0]) * int(a.shape[1]) * int(b.shape[1])
    rows = a.numel() // a.shape[-1]
    return 2 * rows * int(a.shape[-1]) * int(b.shape[-1])


_grouped_mm_flops._get_raw = True  # type: ignore[attr-defined]
# The CPU's fused attention, which torch's flop counter lacks, counted as its CUDA kernels
# are; both take tensors (``_get_raw``), so FlopCounterMode passes them as they are.
_cpu_attention_flops._get_raw = True  # type: ignore[attr-defined]
_cpu_attention_backward_flops._get_raw = True  # type: ignore[attr-defined]
CPU_ATTENTION_FLOPS: dict[Any, Any] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward_flops,
    aten._grouped_mm: _grouped_mm_flops,
}


def op_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    """One operation's FLOPs as torch's flop counter (with the CPU's attention) counts them."""
    packet = func._overloadpacket
    formula = CPU_ATTENTION_FLOPS.get(packet)
    if formula is not None:
        return formula(*args, **kwargs)
    formula = flop_registry.get(packet)
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
