"""Attention whose values are narrower than its queries, counted as a fused kernel runs it.

``scaled_dot_product_attention`` takes the CPU's fused (flash) kernel only when the query,
key and value heads have one width. DeepSeek's multi-head latent attention has wider
queries and keys (rotary and plain parts, 192) than values (128), so on the CPU, and so on
the fake tensors counts run on, it falls back to the math path, which materializes the
``s × s`` scores and saves the softmax's probabilities: at 4,096 tokens and 128 heads,
gigabytes per block of memory and traffic that the GPU kernels training runs on (flash
attention with the values padded, or kernels taking the two widths) never move.
:class:`FusedAttention` runs such calls as the fused kernel over the values padded with
zeros to the queries' width, the output cut back to the values': what is saved and moved
is then the fused kernel's, and the product with the values is counted at the padded
width (an over-count of ``(d_qk − d_v) / (d_qk + d_v)`` of attention's FLOPs, a fifth for
DeepSeek-V3), the way flash attention runs it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__: list[str] = []  # internal: counting runs it

_ATTENTION = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


class FusedAttention(TorchFunctionMode):
    """While active, attention calls with values narrower than the queries run as the
    fused kernel over zero-padded values (see the module docstring); others run as
    called."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _ATTENTION or len(args) < 3:
            return func(*args, **kwargs)
        query, key, value = args[:3]
        width, narrow = query.shape[-1], value.shape[-1]
        if narrow >= width or key.shape[-1] != width:
            return func(*args, **kwargs)
        # The default scale is the queries' width either way: padding changes no score.
        padded = F.pad(value, (0, width - narrow))
        return func(query, key, padded, *args[3:], **kwargs)[..., :narrow]
