"""Profiles a model layer by layer, one layer on the device at a time, leaving it untouched."""

from __future__ import annotations

import math
import platform
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from profiler.batch_sizes import default_batch_sizes, smallest_batch
from profiler.count_pass import CountedLayer, count_layers, counted_profiles, with_counts
from profiler.counting import META
from profiler.devices import resolve_device
from profiler.expert_routing import check_skew
from profiler.layer import CacheFlush, cache_bytes, cold_cache_needed, tensor_bytes
from profiler.layer_naming import layer_names
from profiler.materialize import has_meta
from profiler.measure_pass import MeasureSettings, measure_layers
from profiler.memory_guard import measuring_bytes
from profiler.pooling import pool_identical
from profiler.precision import check_autocast, current_autocast
from profiler.profile import LayerProfile, Profile
from profiler.profile_options import ProfileOptions, with_options
from profiler.samples import resize_sample, sample_arguments, sequential_inputs_problem
from profiler.tied import tied_state

__all__ = ["profile_layers", "profile_model"]

Inputs = tuple[Tensor, ...]


def _device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {dev} requested but CUDA is not available")
    return resolve_device(dev)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or device.type


def _dtype(layers: Sequence[nn.Module], sample: Inputs) -> str:
    """The first floating parameter's dtype, else the sample's."""
    floating: list[Tensor] = [
        p for layer in layers for p in layer.parameters() if p.is_floating_point()
    ]
    tensors = floating or [t for t in sample if t.is_floating_point()] or list(sample)
    return str(tensors[0].dtype).removeprefix("torch.")


def _batch_sizes(batch_sizes: Sequence[int] | None, micro_batch: int, smallest: int) -> list[int]:
    if batch_sizes is None:
        return default_batch_sizes(micro_batch, smallest)
    sizes = list(batch_sizes)
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {sizes}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"batch_sizes must be distinct, got {sizes}")
    return sorted(sizes)


def profile_layers(
    layers: Sequence[nn.Module],
    sample: Tensor | tuple[Any, ...],
    options: ProfileOptions | None = None,
    **overrides: Any,
) -> Profile:
    """Measures the time and memory of each layer of a sequential model.

    Each layer is deep-copied to ``device`` alone, measured at every batch size on the
    previous layer's outputs, then dropped. The given layers, their gradients, devices,
    modes, parameters and buffers, and the global RNG state are left as they were.
    Layers are measured in the mode they are in (``train()`` for training profiles).

    Args:
        layers: the layers in execution order. The first is called with the sample's
            inputs, ``layers[0](*sample)``; each later one with the previous one's
            output as its one argument, a tuple as one tuple, as ``nn.Sequential``
            passes it on.
        sample: one mini-batch, the first layer's positional inputs: a tensor or a
            tuple of tensors, or ``((a, b),)`` for a first layer that takes one tuple;
            dim 0 is the batch.
        options: the options below as one :class:`profiler.profile_options.ProfileOptions`
            (default: all defaults); the keywords are laid over it, and any other keyword
            is refused (``TypeError``).
        device: where to measure.
        chunks: micro-batches per mini-batch; sets the default batch sizes.
        batch_sizes: micro-batch sizes to measure at; default: the micro-batch
            ``ceil(N / chunks)`` and half of it, never below 2 where a BatchNorm trains
            (then the micro-batch and twice it; see
            :func:`profiler.batch_sizes.default_batch_sizes`). Sizes above the sample's
            batch repeat the sample.
        names: one name per layer; default: the positions ``"0"``, ``"1"``, ...
        warmup: untimed runs before timing, per layer and batch size.
        repeats: timed runs, per layer and batch size; the median is kept.
        progress: called as ``progress(done, total, name)`` after each layer.
        pool: give identical layers (same modules, modes, parameter shapes and input
            shapes) the median of their timings, which removes most of the measurement
            noise between repeated blocks; the groups are listed in ``meta["pooled"]``.
        cold_cache: overwrite a scratch buffer larger than the device's caches before
            each timed forward and backward, so a layer reads its weights from memory as
            it does inside a whole step, not from the cache its last repeat left warm.
            ``None`` (default): only when the model's working set (its weights, their
            gradients, its buffers and the activations saved at the micro-batch) exceeds
            the device's largest cache (:func:`profiler.layer.cold_cache_needed`); a
            smaller model keeps its data cached through a real step too. The choice is
            recorded in ``meta["cache"]``.
        autocast: ``bfloat16`` or ``float16``: run every forward and backward under
            ``torch.autocast(device.type, dtype=...)``, as a mixed-precision step does
            (each pass in its own region, so weights are cast in every one). ``None``:
            run as the caller does, under its autocast if it has one. The profile records
            it (:attr:`Profile.autocast`). On the CPU prefer ``bfloat16``: a few layers
            (e.g. ``nn.LSTM``) have no CPU ``float16`` kernel and fail.
        owner: the model whose parameters the layers use (e.g. the model traced into
            them), which names the tensors several layers share in :attr:`Profile.tied`;
            default: ``layer.param`` names.
        shard_styles: one map per layer from its parameters' names (in the layer) to the
            tensor-parallel style of the module owning them (``colwise``, ``rowwise``, ...;
            see :data:`profiler.tp_styles.SHARD_STYLES`); given, each layer's
            :attr:`LayerProfile.shards` is counted (and the counts are required).
            ``autopipe.graph.shard_styles`` makes them from a model's plan.
        expert_skew: the routing counted for routed experts, whose tokens fake tensors
            cannot route (:mod:`profiler.expert_routing`): 1 (default) balanced top-k,
            else the busiest expert receives this many times the mean; a finite number
            >= 1. Each layer holding routed experts gets :attr:`LayerProfile.experts`.

    Returns:
        The profile: per-layer forward/backward seconds and saved/output bytes at each
        batch size, parameter and buffer bytes, and on CUDA the transient peak.

    Raises:
        ValueError: bad layers, sample, chunks, batch sizes, names, counts, autocast or
            expert skew.
        MemoryShortage: a layer's counted bytes (its state, their gradients, its
            activations at the batch sizes) exceed the device's free memory; raised before
            that layer gets storage (a ``ValueError``).
    """
    chosen = with_options(options, overrides, "profile_layers")
    device, chunks, batch_sizes, names = (
        chosen.device,
        chosen.chunks,
        chosen.batch_sizes,
        chosen.names,
    )
    warmup, repeats, progress, pool = chosen.warmup, chosen.repeats, chosen.progress, chosen.pool
    cold_cache, autocast, owner = chosen.cold_cache, chosen.autocast, chosen.owner
    measure = chosen.measure
    layers = list(layers)
    if not layers:
        raise ValueError("cannot profile an empty list of layers")
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise ValueError("every layer must be a torch.nn.Module")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    check_autocast(autocast)
    check_skew(chosen.expert_skew)
    tensors, packed = sample_arguments(sample)
    batch = tensors[0].shape[0]
    micro, smallest = math.ceil(batch / chunks), smallest_batch(layers)
    sizes = _batch_sizes(batch_sizes, micro, smallest)
    layer_names = [str(i) for i in range(len(layers))] if names is None else list(names)
    if len(layer_names) != len(layers):
        raise ValueError(f"got {len(layer_names)} names for {len(layers)} layers")
    dev = _device(device)
    if autocast is None:  # the caller's autocast applies: record it
        autocast = current_autocast(dev.type)
    elif not torch.amp.is_autocast_available(dev.type):
        raise ValueError(f"autocast is not available on {dev.type} devices")

    cuda = [dev.index] if dev.type == "cuda" else []
    on_device: AbstractContextManager[Any] = torch.cuda.device(dev) if cuda else nullcontext()
    stateless = any(has_meta(layer) for layer in layers)
    meta: dict[str, Any] = {}
    with (
        torch.random.fork_rng(devices=cuda),
        on_device,
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        if micro < smallest:
            _check_micro_batch(layers, layer_names, tensors, micro, dev, autocast, packed)
        counted = _count(layers, layer_names, tensors, sizes, dev, autocast, packed, chosen)
        if isinstance(counted, str):
            meta["uncounted"] = counted
            counted = None
        signatures = None if counted is None else [c.signature for c in counted]
        if measure:
            if cold_cache is None:
                working_set = _working_set(layers, counted)
                cold_cache = cold_cache_needed(working_set, dev)
                meta["cache"] = {
                    "cold": cold_cache,
                    "working_set": working_set,
                    "cache_bytes": cache_bytes(dev),
                }
            settings = MeasureSettings(
                dev,
                warmup,
                repeats,
                CacheFlush(dev) if cold_cache else None,
                autocast,
                reuse=pool,
                progress=progress,
            )
            inputs = [resize_sample(tensors, size, dev) for size in sizes]
            input_bytes = [tensor_bytes(x) for x in inputs]
            spreads: list[float] = []
            results, signatures = measure_layers(
                layers,
                layer_names,
                inputs,
                settings,
                packed=packed,
                signatures=signatures,
                spreads=spreads,
                needs=_needs(layers, counted, [input_bytes, *_outputs(counted)]),
            )
            del inputs
            meta["spread"] = _weighted_spread(results, spreads)
        else:
            assert counted is not None  # counting is required without measuring
            input_bytes = [tensor_bytes(resize_sample(tensors, size, META)) for size in sizes]
            results = counted_profiles(layers, layer_names, counted)
            meta["unmeasured"] = True
    if counted is not None:
        results = [with_counts(r, c) for r, c in zip(results, counted, strict=True)]
    if pool and signatures is not None:
        results, groups = pool_identical(results, signatures)
        if groups:
            meta["pooled"] = groups
    if stateless:
        meta["meta_device"] = True
    return Profile(
        layers=results,
        batch_sizes=sizes,
        input=input_bytes,
        batch_size=batch,
        chunks=chunks,
        device=str(dev),
        device_name=_device_name(dev),
        torch_version=str(torch.__version__),
        dtype=_dtype(layers, tensors),
        meta=meta,
        autocast=autocast,
        tied=tied_state(layers, layer_names, owner),
    )


def _working_set(layers: list[nn.Module], counted: list[CountedLayer] | None) -> int:
    """Bytes a training step cycles through: each distinct parameter twice (it and its
    gradient), the buffers, and the activations saved at the largest profiled micro-batch
    size when counted."""
    seen: set[int] = set()
    total = 0
    for layer in layers:
        for kind, tensors in (("p", layer.parameters()), ("b", layer.buffers())):
            for tensor in tensors:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                size = tensor.numel() * tensor.element_size()
                total += 2 * size if kind == "p" and tensor.requires_grad else size
    if counted is not None:
        total += sum(max(n.saved for n in c.counts) for c in counted)
    return total


def _check_micro_batch(
    layers: list[nn.Module],
    names: list[str],
    tensors: Inputs,
    micro: int,
    device: torch.device,
    autocast: str | None,
    packed: bool,
) -> None:
    """Refuses a micro-batch the layers refuse (a batch of one under a 1x1 BatchNorm).

    The sizes measured stay above it, so the profile alone would plan steps that cannot
    run; a count on the meta device tells without measuring. Layers that cannot be
    counted (value-reading code) are left to the measurement.
    """
    try:
        count_layers(
            layers,
            [resize_sample(tensors, micro, META)],
            names,
            device,
            autocast=autocast,
            packed=packed,
        )
    except ValueError as exc:
        if " refuses a micro-batch of " in str(exc):
            raise


def _weighted_spread(layers: list[LayerProfile], spreads: list[float]) -> float:
    """The layers' timing spreads weighted by their times: how far a stage's measured sum
    may move between two profiles (``meta["spread"]``)."""
    times = [sum(layer.forward) + sum(layer.backward) for layer in layers]
    total = sum(times)
    if total <= 0:
        return 0.0
    return float(sum(t * s for t, s in zip(times, spreads, strict=True)) / total)


def _count(
    layers: list[nn.Module],
    names: list[str],
    tensors: Inputs,
    sizes: list[int],
    device: torch.device,
    autocast: str | None,
    packed: bool,
    chosen: ProfileOptions,
) -> list[CountedLayer] | str | None:
    """The count pass, as ``chosen`` asks (``count``, ``measure``, ``shard_styles``); a
    string says why a layer could not be counted (only when the counts are optional: the
    layers have real state, are measured, and no tensor-parallel styles ask for shards)."""
    count, measure, styles = chosen.count, chosen.measure, chosen.shard_styles
    required = not measure or styles is not None or any(has_meta(layer) for layer in layers)
    if not (count or required):
        return None
    inputs = [resize_sample(tensors, size, META) for size in sizes]
    try:
        return count_layers(
            layers,
            inputs,
            names,
            device,
            autocast=autocast,
            packed=packed,
            styles=styles,
            skew=chosen.expert_skew,
        )
    except ValueError as exc:
        if required:
            raise
        return str(exc)


def _outputs(counted: list[CountedLayer] | None) -> list[list[int]]:
    """Each counted layer's output bytes at each batch size: the next layer's input."""
    return [[c.output for c in layer.counts] for layer in counted or []]


def _needs(
    layers: list[nn.Module], counted: list[CountedLayer] | None, inputs: list[list[int]]
) -> list[tuple[int, str]]:
    """The bytes measuring each layer holds (its state alone where it was not counted)."""
    if counted is None:
        return [measuring_bytes(layer, None, inputs[0]) for layer in layers]
    return [
        measuring_bytes(layer, c.counts, x)
        for layer, c, x in zip(layers, counted, inputs[: len(layers)], strict=True)
    ]


def profile_model(model: nn.Sequential, sample: Tensor | tuple[Any, ...], **kwargs: Any) -> Profile:
    """Profiles the children of an ``nn.Sequential``; see :func:`profile_layers`.

    The sample is the model's positional inputs, as ``model(*sample)`` takes them: for
    ``nn.Sequential`` itself one tensor (``x`` or ``(x,)``), or ``((a, b),)`` for a first
    layer that takes a tuple. Between the layers a tuple is one value, as
    ``nn.Sequential`` passes it on. Layer names are the children's names (a traced model's
    units: their modules' dotted names, see :func:`profiler.layer_naming.layer_names`) and
    kinds their class names.

    Raises:
        ValueError: ``model`` is not an ``nn.Sequential``, has no children, or cannot
            take the sample.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"profile_model needs an nn.Sequential, got {type(model).__name__}; wrap the "
            "layers in nn.Sequential or call profile_layers"
        )
    problem = sequential_inputs_problem(model, sample)
    if problem:
        raise ValueError(problem)
    children = list(model.named_children())
    kwargs.setdefault("names", layer_names(model))
    kwargs.setdefault("owner", model)
    return profile_layers([child for _, child in children], sample, **kwargs)
