"""Counts a layer's routed experts on fake tensors, at an assumed routing.

While a layer is counted (:func:`profiler.counting.count_layer`), :func:`routed_experts`

- replaces the forward of each experts module the layer calls as a module by
  :func:`profiler.expert_routing.assumed_forward`, which computes what Hugging Face's
  per-expert loop computes on the assumed token counts;
- watches the operations of a traced layer (a graph of operations in which the experts
  are no module call any more): the router's ``topk`` tells the tokens and ``top_k``, the
  experts' parameters tell which block ran; an integer ``histc`` (the token count per
  expert, which a grouped GEMM's offsets are made of) runs on floats, as the fake
  tensors' CPU kernel needs, since only its shape matters without values.

What expert parallelism divides of the layer is then counted apart: the routed experts of
each block alone, on fake hidden states and routing weights of the sizes the layer gave
them, at the same routing (:class:`ExpertFigures`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from profiler.expert_routing import (
    RoutedCall,
    assumed_forward,
    assumed_tokens,
    expert_weights,
    experts_kernel,
    hidden_size,
    routed_modules,
)
from profiler.layer import storage_key

__all__: list[str] = []

aten = torch.ops.aten
META = torch.device("meta")
_GROUPED_MM = getattr(aten._grouped_mm, "default", None) if hasattr(aten, "_grouped_mm") else None


@dataclass(frozen=True)
class ExpertFigures:
    """One layer's routed experts at one batch size (see :class:`profiler.ExpertCounts`)."""

    experts: int
    top_k: int
    blocks: int
    param_bytes: int
    flops: float
    backward_flops: float
    backward_input_flops: float
    saved: int
    dispatch_bytes: int
    skew: float
    groups: int = 1
    top_groups: int = 1
    traffic: float | None = None
    backward_traffic: float | None = None
    weight_traffic: float | None = None
    backward_weight_traffic: float | None = None
    # What the experts' own traffic changes of the layer's, forward and backward.
    traffic_change: tuple[float, float] = (0.0, 0.0)


@dataclass
class Routed:
    """What one count saw of the layer's routed experts: calls by module name, every
    ``topk`` of the count as ``(rows, choices, k)``, in order, and the blocks a traced
    layer ran as a grouped kernel (``torch._grouped_mm`` on their weights)."""

    skew: float
    calls: dict[str, RoutedCall] = field(default_factory=dict)
    modules: dict[str, nn.Module] = field(default_factory=dict)
    topk: list[tuple[int, int, int]] = field(default_factory=list)
    grouped: set[str] = field(default_factory=set)

    def kernel(self, name: str) -> str:
        """The path block ``name`` ran: ``grouped`` or ``eager``
        (:func:`profiler.expert_routing.experts_kernel`)."""
        return "grouped" if name in self.grouped else experts_kernel(self.modules[name])


def limited_groups(topk: list[tuple[int, int, int]], tokens: int, experts: int) -> tuple[int, int]:
    """``(groups, top_groups)`` of group-limited routing, ``(1, 1)`` where there is none.

    DeepSeek's router (``n_group``, ``topk_group``) first chooses ``top_groups`` of
    ``groups`` equal groups of experts for each token, then its experts among theirs: a
    ``topk`` over the same tokens with ``groups`` choices (dividing the experts, fewer than
    them) before the one over the experts. Expert parallelism that places whole groups on
    nodes sends each token to at most ``top_groups`` nodes.
    """
    last = max((i for i, (_, choices, _) in enumerate(topk) if choices == experts), default=-1)
    for rows, choices, k in reversed(topk[:last]):
        if rows == tokens and 1 < choices < experts and experts % choices == 0 and k < choices:
            return choices, k
    return 1, 1


class RoutingWatch(TorchDispatchMode):
    """Follows a traced layer's routing: ``topk`` calls and uses of experts' parameters.

    Args:
        routed: where a block seen through its parameters is recorded.
        owners: storage identity of each experts parameter -> its module's name.
        autocast: the autocast dtype, which the experts' matmuls run in.
    """

    def __init__(self, routed: Routed, owners: dict[int, str], autocast: str | None) -> None:
        super().__init__()
        self.routed = routed
        self.owners = owners
        self.autocast = autocast

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.histc.default and not args[0].is_floating_point():
            # Only the shape counts on fake tensors; the CPU kernel takes no integers.
            args = (args[0].float(), *args[1:])
        out = func(*args, **kwargs)
        if func is aten.topk.default and args[0].dim() >= 2:
            scores = args[0]
            self.routed.topk.append(
                (scores.numel() // scores.shape[-1], scores.shape[-1], int(args[1]))
            )
        elif self.owners:
            for value in tree_leaves((args, kwargs)):
                if isinstance(value, Tensor):
                    name = self.owners.get(storage_key(value)[0])
                    if name is not None and func is _GROUPED_MM:
                        self.routed.grouped.add(name)
                    if name is not None and name not in self.routed.calls:
                        self._seen(name)
        return out

    def _seen(self, name: str) -> None:
        """A block whose parameters an operation used: its call, from the last ``topk``
        over as many choices as it has experts."""
        module = self.routed.modules[name]
        found = expert_weights(module)
        assert found is not None
        up, down = found
        experts = int(up.shape[0])
        for rows, choices, k in reversed(self.routed.topk):
            if choices == experts:
                dtype = getattr(torch, self.autocast) if self.autocast else up.dtype
                width = hidden_size(module, up, down)
                self.routed.calls[name] = RoutedCall(rows, k, experts, dtype, dtype, width)
                return


@contextlib.contextmanager
def routed_experts(
    layer: nn.Module, skew: float, autocast: str | None
) -> Iterator[tuple[Routed, TorchDispatchMode]]:
    """Routes the experts of ``layer`` by the assumption for the block (see the module's
    docstring); yields the record and the watch, to run over the layer's passes.

    Enter it where the layer's state is what it runs with (its fake tensors).
    """
    routed = Routed(skew)
    owners: dict[int, str] = {}
    patched: list[tuple[nn.Module, Any]] = []
    for name, module in routed_modules(layer):
        routed.modules[name] = module
        for tensor in module._parameters.values():
            if tensor is not None:
                owners[storage_key(tensor)[0]] = name

        def record(call: RoutedCall, name: str = name) -> None:
            routed.calls[name] = call

        patched.append((module, module.__dict__.get("forward")))
        module.forward = functools.partial(_routed_forward, module, skew=skew, record=record)
    try:
        yield routed, RoutingWatch(routed, owners, autocast)
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _routed_forward(
    module: nn.Module,
    *args: Any,
    skew: float,
    record: Callable[[RoutedCall], None],
    **kwargs: Any,
) -> Tensor:
    tensors = [*args, *kwargs.values()]
    if len(tensors) != 3 or not all(isinstance(t, Tensor) for t in tensors):
        raise TypeError(
            f"experts module {type(module).__name__} is called with {len(tensors)} "
            "arguments, not as experts(hidden_states, top_k_index, top_k_weights)"
        )
    hidden, index, weights = tensors
    return assumed_forward(module, hidden, index, weights, skew, record)


def one_expert(module: nn.Module, experts: int) -> nn.Module:
    """A copy of an experts module on the meta device holding its first expert alone:
    every parameter stacked over the ``experts`` sliced to its first row. The eager loop
    takes each expert's weights as a slice of the stacked ones, whose backward writes a
    gradient of the whole stack per expert; a grouped kernel writes each expert's own."""
    single = copy.deepcopy(module).to(META)
    for owner in single.modules():
        for name, param in list(owner._parameters.items()):
            if param is not None and param.dim() >= 2 and param.shape[0] == experts:
                owner._parameters[name] = nn.Parameter(
                    torch.empty((1, *param.shape[1:]), dtype=param.dtype, device=META),
                    requires_grad=param.requires_grad,
                )
    return single


class _Alone(nn.Module):
    """Routed experts alone, each on the tokens ``counts`` gives it (routing values are
    never read)."""

    def __init__(self, experts: nn.Module, counts: list[int], kernel: str) -> None:
        super().__init__()
        self.experts = experts
        self.counts = counts
        self.kernel = kernel

    def forward(self, hidden: Tensor, weights: Tensor) -> Tensor:
        index = weights.new_empty(weights.shape, dtype=torch.long)
        return assumed_forward(
            self.experts, hidden, index, weights, 1.0, lambda call: None, self.counts, self.kernel
        )


# count(layer, inputs) -> (flops, backward_flops, backward_input_flops, saved, traffic,
# backward_traffic)
Counter = Callable[[nn.Module, tuple[Tensor, ...]], tuple[float, float, float, int, float, float]]


def expert_figures(routed: Routed, count: Counter) -> ExpertFigures | None:
    """The routed experts' figures of one count, ``None`` when the layer routed no tokens.

    Each expert's figures are its own (fresh tensors, its own matmuls), so experts of
    equal token counts count alike: ``count`` counts one expert per distinct token count
    (on its own fake state), times the experts that receive it, which keeps 256 experts
    as cheap as 8.

    Their memory traffic is counted as a grouped kernel moves it: each expert on its own
    rows and its own weights only (gathered in, its matmuls, combined out), and of it the
    part that does not follow the rows (counted at twice the rows: the weights read, their
    gradients written and accumulated), which expert parallelism divides. The eager
    loop's indexing and ``index_add_`` read and write the whole token tensor once per
    expert, and its backward the whole stack of weights, which the layer's own count
    includes; ``traffic_change`` gives what replacing that by the experts' own traffic
    changes of the layer's (none for experts that run the grouped path, whose count is
    a grouped kernel's already).
    """
    if not routed.calls:
        return None
    totals = [0.0] * 6
    eager = [0.0, 0.0]
    fixed = [0.0, 0.0]
    params = dispatch = 0
    # One group limit where every block of the layer has the same, else none.
    limits = {limited_groups(routed.topk, c.tokens, c.experts) for c in routed.calls.values()}
    groups, top_groups = limits.pop() if len(limits) == 1 else (1, 1)
    for name, call in routed.calls.items():
        module = routed.modules[name]
        tokens = assumed_tokens(call.tokens, call.top_k, call.experts, routed.skew)
        hidden = torch.empty((call.tokens, call.width), dtype=call.hidden, device=META)
        weights = torch.empty((call.tokens, call.top_k), dtype=call.weights, device=META)
        single = one_expert(module, call.experts)
        kernel = routed.kernel(name)
        grouped = kernel == "grouped"
        for size, times in Tally(n for n in tokens if n).items():
            found = count(_Alone(module, [size], kernel), (hidden, weights))
            for i, value in enumerate(found[:4]):
                totals[i] += times * value
            # An expert on its own rows and weights: its traffic in a grouped kernel.
            rows = torch.empty((size, call.width), dtype=call.hidden, device=META)
            picked = torch.empty((size, call.top_k), dtype=call.weights, device=META)
            own = count(_Alone(single, [size], kernel), (rows, picked))
            # Twice the rows: what follows the rows, and what does not (its weights).
            rows = torch.empty((2 * size, call.width), dtype=call.hidden, device=META)
            picked = torch.empty((2 * size, call.top_k), dtype=call.weights, device=META)
            more = count(_Alone(single, [2 * size], kernel), (rows, picked))
            added: tuple[float, ...] = own
            if not grouped:  # one more expert in the eager loop over all the tokens
                twice = count(_Alone(module, [size, size], kernel), (hidden, weights))
                added = tuple(a - b for a, b in zip(twice, found, strict=True))
            for i in (0, 1):
                totals[4 + i] += times * own[4 + i]
                fixed[i] += times * max(2.0 * own[4 + i] - more[4 + i], 0.0)
                eager[i] += times * added[4 + i]
        params += sum(p.numel() * p.element_size() for p in module.parameters())
        dispatch += call.tokens * call.top_k * call.width * hidden.element_size()
    calls = list(routed.calls.values())
    return ExpertFigures(
        experts=max(c.experts for c in calls),
        top_k=max(c.top_k for c in calls),
        blocks=len(calls),
        param_bytes=params,
        flops=totals[0],
        backward_flops=totals[1],
        backward_input_flops=totals[2],
        saved=int(totals[3]),
        dispatch_bytes=dispatch,
        traffic=totals[4],
        backward_traffic=totals[5],
        weight_traffic=fixed[0],
        backward_weight_traffic=fixed[1],
        traffic_change=(totals[4] - eager[0], totals[5] - eager[1]),
        skew=routed.skew,
        groups=groups,
        top_groups=top_groups,
    )
