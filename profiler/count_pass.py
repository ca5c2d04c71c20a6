"""Counts every layer of a model in order, without storage: each distinct layer once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from profiler.batch_sizes import batch_refusal
from profiler.counting import LayerCounts, count_layer, fresh_like, meta_copy
from profiler.expert_counts import ExpertCounts
from profiler.expert_routing import unassumed_routing
from profiler.layer import OneValue, with_grad
from profiler.pooling import layer_signature
from profiler.profile import LayerProfile
from profiler.shard_counts import ShardCounts
from profiler.tp_styles import check_styles

__all__: list[str] = []

Inputs = tuple[Tensor, ...]


@dataclass(frozen=True)
class CountedLayer:
    """One layer's counts at each batch size, and what identifies its cost.

    Attributes:
        signature: equal for layers that do the same work (:func:`layer_signature`).
        counts: one per batch size.
        first: the index of the first layer with this signature (itself when new).
    """

    signature: str
    counts: list[LayerCounts]
    first: int


def count_layers(
    layers: Sequence[nn.Module],
    inputs: Sequence[Inputs],
    names: Sequence[str],
    device: torch.device,
    *,
    autocast: str | None = None,
    packed: bool = False,
    styles: Sequence[Mapping[str, str]] | None = None,
    skew: float = 1.0,
) -> list[CountedLayer]:
    """Counts the layers in order, each on the previous one's outputs.

    A layer with the signature of one counted before (same code, modes, state shapes and
    input shapes) does the same work and returns the same shapes: it takes that layer's
    counts, so a model of 80 identical blocks costs one block's count.

    Args:
        layers: the layers, on any device (the meta device included); they are not run,
            storage-free copies are.
        inputs: the first layer's inputs at each batch size, on the meta device.
        names: the layers' names, for error messages.
        device: whose kernels to count (see :func:`profiler.counting.count_layer`).
        autocast: the autocast dtype the layers run under, or ``None``.
        packed: the first layer takes its inputs as one tuple.
        styles: one map per layer of its parameters' tensor-parallel styles (by name in
            the layer); given, every layer's counts include its shards
            (:mod:`profiler.shard_counting`).
        skew: the routing assumed for routed experts, whose tokens fake tensors cannot
            route (:mod:`profiler.expert_routing`): 1 balanced, else the busiest expert's
            tokens over the mean.

    Raises:
        ValueError: a layer cannot run without tensor values; the message names it.
    """
    results: list[CountedLayer] = []
    seen: dict[str, tuple[int, list[Inputs], bool]] = {}
    # As in :func:`profiler.measure_pass.measure_layers`: the first layer's floating
    # inputs get gradients, later ones what the previous layer's outputs require.
    current = [tuple(with_grad(t, True) for t in x) for x in inputs]
    if styles is not None and len(styles) != len(layers):
        raise ValueError(f"got {len(styles)} style maps for {len(layers)} layers")
    for given, name in zip(styles or [], names, strict=False):
        check_styles(given, f"layer {name}")
    for index, (layer, name) in enumerate(zip(layers, names, strict=True)):
        own = None if styles is None else styles[index]
        signature = layer_signature(layer, current) + f"#packed={packed}"
        if own is not None:  # by position: each block names its parameters its own way
            signature += "#styles=" + ",".join(
                own.get(n, "") for n, _ in layer.named_parameters(remove_duplicate=False)
            )
        if signature in seen:
            first, outputs, packed = seen[signature]
            results.append(CountedLayer(signature, results[first].counts, first))
            current = [fresh_like(out) for out in outputs]
            continue
        label = f"layer {name} ({type(layer).__name__})"
        counts, outputs = [], []
        returns_tuple = False
        for x in current:
            call = meta_copy(layer)
            # OneValue holds the layer as ``layer``, which prefixes its parameters' names.
            named = own if own is None or not packed else {f"layer.{k}": v for k, v in own.items()}
            try:
                found, out, returns_tuple = count_layer(
                    OneValue(call) if packed else call,
                    x,
                    device,
                    label=label,
                    autocast=autocast,
                    styles=named,
                    skew=skew,
                    grads=[t.requires_grad for t in x],
                )
            except Exception as exc:
                # A size the layer refuses is refused with real weights too.
                refusal = batch_refusal(exc, label, x)
                if refusal is not None:
                    raise ValueError(refusal) from None
                message = " ".join(str(exc).split())[:300]
                routing = unassumed_routing(call)
                if routing is not None:
                    raise ValueError(
                        f"cannot count {label} without tensor values: {routing}"
                    ) from None
                raise ValueError(
                    f"cannot count {label} without tensor values: {type(exc).__name__}: "
                    f"{message}. Code that reads values (.item(), nonzero, data-dependent "
                    "shapes) needs real weights: build "
                    "the model on a real device and measure it (without --target)"
                ) from None
            counts.append(found)
            outputs.append(out)
        seen[signature] = (index, outputs, returns_tuple)
        results.append(CountedLayer(signature, counts, index))
        current = [fresh_like(out) for out in outputs]
        packed = returns_tuple
    return results


def counted_profiles(
    layers: list[nn.Module], names: list[str], counted: list[CountedLayer]
) -> list[LayerProfile]:
    """Profiles with the counted bytes and zero times, for layers that are not measured."""
    results: list[LayerProfile] = []
    previous: list[int] | None = None
    for layer, name, found in zip(layers, names, counted, strict=True):
        zeros = [0.0] * len(found.counts)
        results.append(
            LayerProfile(
                name=name,
                kind=type(layer).__name__,
                forward=zeros,
                backward=list(zeros),
                backward_input=list(zeros),
                saved=[c.saved for c in found.counts],
                gemm_saved=[c.gemm_saved for c in found.counts],
                output=[c.output for c in found.counts],
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers()),
                shared=[0] * len(found.counts)
                if previous is None
                else [min(c.input_saved, p) for c, p in zip(found.counts, previous, strict=True)],
            )
        )
        previous = [c.output_saved for c in found.counts]
    return results


def shard_counts(counts: Sequence[LayerCounts]) -> ShardCounts | None:
    """One layer's shard figures at each batch size as a :class:`ShardCounts`, ``None``
    when it was counted without a tensor-parallel plan."""
    figures = [c.shards for c in counts]
    if not figures or any(f is None for f in figures):
        return None
    found = [f for f in figures if f is not None]
    first = found[0]
    return ShardCounts(
        flops=[f.flops for f in found],
        backward_flops=[f.backward_flops for f in found],
        backward_input_flops=[f.backward_input_flops for f in found],
        traffic=[f.traffic for f in found],
        backward_traffic=[f.backward_traffic for f in found],
        saved=[f.saved for f in found],
        param_bytes=first.param_bytes,
        reduce_forward=[f.reduce_forward for f in found],
        reduce_backward=[f.reduce_backward for f in found],
        reductions=max(f.reductions for f in found),
        replicated_saved=[f.replicated_saved for f in found],
        attention_flops=[f.attention_flops for f in found],
        attention_backward_flops=[f.attention_backward_flops for f in found],
        kv_bytes=[f.kv_bytes for f in found],
        attention_calls=max(f.attention_calls for f in found),
        heads=max(f.heads for f in found),
        kv_heads=max(f.kv_heads for f in found),
    )


def with_counts(profile: LayerProfile, counted: CountedLayer) -> LayerProfile:
    """The profile with the counts of ``counted`` at each batch size."""
    counts = counted.counts
    return replace(
        profile,
        flops=[c.flops for c in counts],
        backward_flops=[c.backward_flops for c in counts],
        backward_input_flops=[c.backward_input_flops for c in counts],
        traffic=[c.traffic for c in counts],
        backward_traffic=[c.backward_traffic for c in counts],
        operations=[float(c.operations) for c in counts],
        backward_operations=[float(c.backward_operations) for c in counts],
        # Of the bytes measured: counted and measured saved sets may differ a little.
        norm_saved=[min(c.norm_saved, s) for c, s in zip(counts, profile.saved, strict=True)],
        norm_flops=[c.norm_flops for c in counts],
        norm_traffic=[c.norm_traffic for c in counts],
        norm_operations=[float(c.norm_operations) for c in counts],
        up_proj_saved=[min(c.up_proj_saved, s) for c, s in zip(counts, profile.saved, strict=True)],
        up_proj_flops=[c.up_proj_flops for c in counts],
        up_proj_traffic=[c.up_proj_traffic for c in counts],
        up_proj_operations=[float(c.up_proj_operations) for c in counts],
        shards=shard_counts(counts),
        experts=expert_counts(counts),
    )


def expert_counts(counts: Sequence[LayerCounts]) -> ExpertCounts | None:
    """One layer's routed experts at each batch size as an :class:`ExpertCounts`,
    ``None`` for a layer without them."""
    figures = [c.experts for c in counts]
    if not figures or any(f is None for f in figures):
        return None
    found = [f for f in figures if f is not None]
    first = found[0]
    return ExpertCounts(
        experts=first.experts,
        top_k=first.top_k,
        blocks=first.blocks,
        param_bytes=first.param_bytes,
        flops=[f.flops for f in found],
        backward_flops=[f.backward_flops for f in found],
        backward_input_flops=[f.backward_input_flops for f in found],
        saved=[f.saved for f in found],
        dispatch_bytes=[f.dispatch_bytes for f in found],
        skew=first.skew,
        groups=first.groups,
        top_groups=first.top_groups,
        traffic=[float(f.traffic or 0.0) for f in found],
        backward_traffic=[float(f.backward_traffic or 0.0) for f in found],
        weight_traffic=[float(f.weight_traffic or 0.0) for f in found],
        backward_weight_traffic=[float(f.backward_weight_traffic or 0.0) for f in found],
    )
