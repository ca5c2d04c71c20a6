"""A Llama that keeps for backward what fused training kernels keep, for planning Megatron runs.

Hugging Face's Llama runs its RMSNorm and SwiGLU as separate eager operations, and autograd
keeps their intermediates: counted on fake tensors, a decoder block of hidden size h saves
about 58.6·h bytes per token in bfloat16. Megatron-LM (with Transformer Engine) runs both as
fused kernels that keep only their inputs (and the norm's reciprocal RMS) and recompute the
rest in backward: about 36·h bytes per token (Korthikanti et al. 2022 count 34·h for a GPT
block with a 4h MLP; SwiGLU's 3.5h gate and up add the difference). Planning a published
Megatron run with the eager model would charge it two thirds more activation memory than
the run had.

:func:`fuse` swaps a Hugging Face Llama's norms and MLP activations for autograd functions
that keep what the fused kernels keep: the same parameters and module names (so its TP plan
applies unchanged), the same outputs and gradients (tests/benchmarks check both against the
eager model), fewer saved bytes. Linear layers are unchanged: under FP8 Transformer Engine
keeps their inputs in FP8 (1 byte, not 2), which this model does not reproduce.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = ["FusedRMSNorm", "fuse", "swiglu"]


# Custom operators rather than autograd functions: tracing (torch.export) keeps a custom
# operator as one call with its own autograd, where it would inline a function's forward and
# let autograd keep what the inlined operations keep.
@torch.library.custom_op("autopipe_bench::rms_norm", mutates_args=())
def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (wide * rstd).to(x.dtype), rstd


@_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    wide = torch.promote_types(x.dtype, torch.float32)
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty((*x.shape[:-1], 1), dtype=wide)


def _rms_norm_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])  # the input and 1 / rms(x) only


def _rms_norm_backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[Any, Any, None]:
    x, weight, rstd = ctx.saved_tensors
    wide = rstd.dtype
    normed = x.to(wide) * rstd
    dims = tuple(range(grad.dim() - 1))
    grad_weight = (grad.to(wide) * normed.to(x.dtype).to(wide)).sum(dim=dims)
    scaled = grad.to(wide) * weight.to(wide)
    mean = (scaled * normed).mean(-1, keepdim=True)
    grad_x = (rstd * (scaled - normed * mean)).to(x.dtype)
    return grad_x, grad_weight.to(weight.dtype), None


_rms_norm.register_autograd(_rms_norm_backward, setup_context=_rms_norm_context)


@torch.library.custom_op("autopipe_bench::swiglu", mutates_args=())
def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


@_swiglu.register_fake
def _(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(gate)


def _swiglu_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)  # gate and up only


def _swiglu_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = ctx.saved_tensors
    sigmoid = torch.sigmoid(gate)
    grad_up = grad * gate * sigmoid
    grad_gate = grad * up * sigmoid * (1 + gate * (1 - sigmoid))
    return grad_gate, grad_up


_swiglu.register_autograd(_swiglu_backward, setup_context=_swiglu_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` as a fused kernel keeps it for backward: its two inputs."""
    out: torch.Tensor = _swiglu(gate, up)
    return out


class FusedRMSNorm(nn.Module):
    """RMSNorm with a ``weight`` as Hugging Face's, keeping what a fused kernel keeps."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _rms_norm(x, self.weight, self.eps)[0]
        return out


class _FusedMLP(nn.Module):
    """A Llama MLP whose activation is :func:`swiglu`, with the same projections."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return out


# Causal attention without a mask, as Megatron's and torchtitan's kernels run it: an
# attention implementation Hugging Face builds no mask for (its mask functions know only
# their own implementations' names), whose calls are SDPA's with ``is_causal``. Traced, the
# eager model would build the whole s × s mask, send it between stages and save a float
# copy of it in every block: 2·s bytes per token per block that these runs never hold.
CAUSAL = "autopipe_causal_sdpa"
AttentionInterface.register(CAUSAL, sdpa_attention_forward)


def fuse(model: nn.Module) -> nn.Module:
    """Swaps ``model``'s RMSNorms and Llama MLPs for the fused-kernel forms, in place, and
    makes its attention causal without a mask (:data:`CAUSAL`).

    Any module whose class name ends in ``RMSNorm`` (with ``weight`` and
    ``variance_epsilon``) and any with ``gate_proj``, ``up_proj`` and ``down_proj``
    children is replaced; parameters are shared, not copied.
    """
    config = getattr(model, "config", None)
    if config is not None:
        config._attn_implementation = CAUSAL
    _fuse(model)
    return model


def _fuse(model: nn.Module) -> None:
    for name, child in list(model.named_children()):
        if type(child).__name__.endswith("RMSNorm") and hasattr(child, "variance_epsilon"):
            setattr(model, name, FusedRMSNorm(child.weight, child.variance_epsilon))
        elif all(hasattr(child, p) for p in ("gate_proj", "up_proj", "down_proj")):
            setattr(model, name, _FusedMLP(child))
        else:
            _fuse(child)
