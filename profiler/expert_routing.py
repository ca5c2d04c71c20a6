"""Routes a mixture of experts' tokens by an assumption, where tensors hold no values.

A router picks each token's experts from its values, which fake tensors do not have, so
a count cannot know how many tokens each expert receives. It assumes instead: balanced
top-k (each of ``E`` routed experts receives ``tokens * top_k / E`` tokens, the remainder
one more each for the first experts), or a skew (the busiest expert receives ``skew``
times that mean, the others share the rest evenly).

Routed experts are found by their structure, Hugging Face's experts modules' (called as
``experts(hidden_states, top_k_index, top_k_weights)``): 3-d parameters ``down_proj`` and
``gate_up_proj`` (or ``up_proj``) holding one matrix per expert. While a layer is counted,
their forward is replaced by :func:`assumed_forward`, the operations of the kernel the
model chose (:func:`experts_kernel`) on the assumed token counts:

- ``eager``: Hugging Face's per-expert loop (gather the tokens, up projection,
  activation, down projection, routing weight, ``index_add_``);
- ``grouped``: Hugging Face's ``grouped_mm`` experts (its default where
  ``torch._grouped_mm`` runs): the tokens gathered once in expert order, one grouped
  matmul per projection over them, the routing weight, the inverse permutation and a sum
  over each token's choices. It keeps for the backward what that path keeps (the gathered
  tokens, each projection's input, the indices and the offsets; not ``index_add_``'s
  source), with one matmul per expert on its rows standing for the grouped one (the same
  FLOPs, in any dtype).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["assumed_tokens"]


def check_skew(skew: object, what: str = "expert_skew") -> float:
    """``skew`` as a float, refused unless a finite number >= 1.

    Raises:
        ValueError: one line naming ``what``.
    """
    if isinstance(skew, bool) or not isinstance(skew, (int, float)):
        raise ValueError(f"{what} must be a number >= 1 (1: balanced routing), got {skew!r}")
    value = float(skew)
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(
            f"{what} must be a finite number >= 1 (the busiest expert's tokens over the "
            f"mean; 1: balanced routing), got {skew!r}"
        )
    return value


def assumed_tokens(tokens: int, top_k: int, experts: int, skew: float = 1.0) -> list[int]:
    """The tokens each routed expert receives under the assumption, busiest first.

    Args:
        tokens: tokens entering the router.
        top_k: experts each token is sent to (distinct ones).
        experts: routed experts.
        skew: the busiest expert's tokens over the mean ``tokens * top_k / experts``
            (1: balanced); it receives at most every token once.

    Returns:
        ``experts`` counts summing to ``tokens * top_k``, none above ``tokens``.
    """
    total = tokens * top_k
    if skew <= 1 or experts == 1:
        base, extra = divmod(total, experts)
        return [base + 1] * extra + [base] * (experts - extra)
    busiest = min(tokens, max(-(-total // experts), round(skew * total / experts)))
    base, extra = divmod(total - busiest, experts - 1)
    return [busiest] + [base + 1] * extra + [base] * (experts - 1 - extra)


def expert_weights(module: nn.Module) -> tuple[Tensor, Tensor] | None:
    """The up (or gate and up) and down projections of routed experts, ``None`` for a
    module that holds none: 3-d parameters with one matrix per expert."""
    params = module._parameters
    up = params.get("gate_up_proj")
    if up is None:
        up = params.get("up_proj")
    down = params.get("down_proj")
    if up is None or down is None or up.dim() != 3 or down.dim() != 3:
        return None
    if up.shape[0] != down.shape[0]:
        return None
    return up, down


def routed_modules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``layer`` that hold routed experts, by name."""
    return [(name, m) for name, m in layer.named_modules() if expert_weights(m) is not None]


@dataclass
class RoutedCall:
    """One call of a routed-experts module, as counted.

    Attributes:
        tokens: tokens routed (rows of the hidden states).
        top_k: experts per token.
        experts: routed experts.
        hidden: the hidden states' dtype.
        weights: the routing weights' dtype.
        width: the hidden size.
    """

    tokens: int
    top_k: int
    experts: int
    hidden: torch.dtype
    weights: torch.dtype
    width: int


def _transposed(module: nn.Module, up: Tensor, down: Tensor) -> bool:
    """Weights stored as ``(in, out)`` per expert; the module says so where it can."""
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool):
        return flag
    return bool(up.shape[-2] == down.shape[-1] and up.shape[-1] != down.shape[-2])


def hidden_size(module: nn.Module, up: Tensor, down: Tensor) -> int:
    """The hidden size the experts take and return."""
    return int(up.shape[-2] if _transposed(module, up, down) else up.shape[-1])


def _project(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def _gate(module: nn.Module, projected: Tensor) -> Tensor:
    apply = getattr(module, "_apply_gate", None)
    if callable(apply):
        return apply(projected)
    gate, up = projected.chunk(2, dim=-1)
    return _activation(module)(gate) * up


def _activation(module: nn.Module) -> Callable[[Tensor], Tensor]:
    act = getattr(module, "act_fn", None)
    return act if callable(act) else F.silu  # a traced unit's stand-in keeps no act_fn


# Hugging Face's experts implementations (``config._experts_implementation``) that run
# the grouped path; the others (``eager``, and ``batched_mm``, which gathers each token's
# expert weights) are counted as the eager loop.
GROUPED_IMPLEMENTATIONS = ("grouped_mm",)


def experts_kernel(module: nn.Module) -> str:
    """``grouped`` where the experts module runs Hugging Face's grouped path, else
    ``eager``: read from the model's config the module holds (a traced unit's stand-in
    holds none: eager)."""
    config = getattr(module, "config", None)
    chosen = getattr(config, "_experts_implementation", None)
    return "grouped" if chosen in GROUPED_IMPLEMENTATIONS else "eager"


class _KeepOffsets(torch.autograd.Function):
    """The identity on the gathered tokens that keeps the grouped kernel's offsets for
    the backward, as ``torch._grouped_mm`` does: the per-expert matmuls standing for it
    keep none."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, offsets: Tensor) -> Tensor:
        ctx.save_for_backward(offsets)
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _grouped_forward(
    module: nn.Module,
    hidden_states: Tensor,
    top_k_weights: Tensor,
    counts: Sequence[int],
    transposed: bool,
) -> Tensor:
    """Hugging Face's grouped experts path on the assumed token counts (see the module's
    docstring); the sort's indices are zeros, whose values nothing reads."""
    up, down = expert_weights(module) or (None, None)
    assert up is not None and down is not None
    tokens, top_k = int(hidden_states.shape[0]), int(top_k_weights.shape[-1])
    rows = sum(counts)
    gated = "gate_up_proj" in module._parameters
    up_bias = getattr(module, "gate_up_proj_bias" if gated else "up_proj_bias", None)
    down_bias = getattr(module, "down_proj_bias", None)
    # The sort's outputs: each copy's expert in expert order, and the permutation.
    ids = top_k_weights.new_zeros(rows, dtype=torch.long)
    perm = torch.zeros_like(ids)
    selected = hidden_states[perm // top_k]
    weights = top_k_weights.reshape(-1)[perm]
    offsets = hidden_states.new_zeros(len(counts), dtype=torch.int32)
    selected = _KeepOffsets.apply(selected, offsets)

    def grouped(x: Tensor, stacked: Tensor, bias: Tensor | None) -> Tensor:
        # Split once: the rows' and the weights' gradients are each written once, as the
        # grouped kernel writes them, not once per expert as slicing each would.
        pieces, each = x.split(list(counts)), stacked.unbind(0)
        out = torch.cat(
            [_project(pieces[e], each[e], None, transposed) for e, n in enumerate(counts) if n]
        )
        return out if bias is None else out + bias[ids]

    projected = grouped(selected, up, up_bias)
    inner = _gate(module, projected) if gated else _activation(module)(projected)
    out = grouped(inner, down, down_bias)
    if getattr(module, "has_post_expert_norm", False):
        out = module.get_submodule("post_expert_norm")(out)
    weighted = (out * weights.unsqueeze(-1))[torch.zeros_like(perm)]  # the inverse order
    if rows != tokens * top_k:  # some experts alone (their figures): their rows only
        return weighted.to(hidden_states.dtype)
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def assumed_forward(
    module: nn.Module,
    hidden_states: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    skew: float,
    record: Callable[[RoutedCall], None],
    counts: Sequence[int] | None = None,
    kernel: str | None = None,
) -> Tensor:
    """The experts' path (``kernel``, ``eager`` or ``grouped``; by default the one the
    module chose, :func:`experts_kernel`) on the assumed token counts (``counts``, one
    per expert from the first, where given).

    Each expert's token and top-k positions are fresh index tensors of its assumed size,
    one ``(n, 2)`` storage as ``torch.where`` makes them; their values are never read (zeros:
    real tensors, too, would index in bounds).
    """
    found = expert_weights(module)
    assert found is not None
    up, down = found
    experts, top_k = int(up.shape[0]), int(top_k_index.shape[-1])
    tokens = int(hidden_states.shape[0])
    record(
        RoutedCall(
            tokens,
            top_k,
            experts,
            hidden_states.dtype,
            top_k_weights.dtype,
            hidden_states.shape[-1],
        )
    )
    transposed = _transposed(module, up, down)
    if counts is None:
        counts = assumed_tokens(tokens, top_k, experts, skew)
    if (kernel or experts_kernel(module)) == "grouped":
        return _grouped_forward(module, hidden_states, top_k_weights, counts, transposed)
    gated = "gate_up_proj" in module._parameters
    up_bias = getattr(module, "gate_up_proj_bias" if gated else "up_proj_bias", None)
    down_bias = getattr(module, "down_proj_bias", None)
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():  # the expert mask, as the eager loop builds it
        mask = top_k_index.new_zeros((experts + 1, top_k, tokens))
        mask.sum(dim=(-1, -2)).gt(0)
    for expert, count in enumerate(counts):
        if count == 0:
            continue  # the eager loop visits only the experts hit
        top_k_pos, token_idx = mask[expert].new_zeros((count, 2)).unbind(1)
        current = hidden_states[token_idx]
        bias = None if up_bias is None else up_bias[expert]
        projected = _project(current, up[expert], bias, transposed)
        inner = _gate(module, projected) if gated else _activation(module)(projected)
        bias = None if down_bias is None else down_bias[expert]
        out = _project(inner, down[expert], bias, transposed)
        if getattr(module, "has_post_expert_norm", False):
            norm = module.get_submodule("post_expert_norm")
            out = norm(out)
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def unassumed_routing(layer: nn.Module) -> str | None:
    """Why the routing of ``layer`` cannot be assumed, ``None`` when it holds no experts
    but those :func:`assumed_forward` stands in for.

    Experts held as separate modules (an ``nn.ModuleList`` named ``experts``) are picked
    by code of the model's own that reads the router's values, which no assumption
    replaces.
    """
    for name, module in layer.named_modules():
        last = name.rpartition(".")[2].lower()
        if "expert" in last and "shared" not in last and isinstance(module, nn.ModuleList):
            return (
                f"its mixture of experts {name} ({type(module).__name__} of "
                f"{len(module)} {type(module[0]).__name__ if len(module) else 'modules'}) "
                "is routed by code that reads the router's values; the routing is assumed "
                "only for experts modules called as experts(hidden_states, top_k_index, "
                "top_k_weights) with 3-d gate_up_proj (or up_proj) and down_proj weights, "
                "as Hugging Face's are: build the model on a real device and measure it "
                "(without --target)"
            )
    return None
