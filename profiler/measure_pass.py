"""Measures every layer of a model in order on one device: each distinct layer once."""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from profiler.batch_sizes import batch_refusal
from profiler.layer import (
    CacheFlush,
    LayerFigures,
    OneValue,
    as_tensors,
    measure_layer,
    tensor_bytes,
    with_grad,
)
from profiler.materialize import has_meta, materialize
from profiler.memory_guard import check_fits
from profiler.pooling import layer_signature
from profiler.precision import autocast_pass
from profiler.profile import LayerProfile

__all__: list[str] = []

Inputs = tuple[Tensor, ...]

# Replicas kept for layers whose later twins are not known in advance (no count pass):
# repeated blocks follow each other, so a few recent ones cover them.
_RECENT = 4


@dataclass(frozen=True)
class MeasureSettings:
    """How each layer is timed (see :func:`profiler.measure.profile_layers`).

    Attributes:
        device: where the layers run.
        warmup: untimed runs before the timed ones.
        repeats: timed runs.
        flush: what empties the device's cache before each run, or ``None``.
        autocast: the autocast dtype, or ``None``.
        reuse: measure identical layers once; ``False``: measure every layer.
        progress: called as ``progress(done, total, name)`` after each layer.
    """

    device: torch.device
    warmup: int
    repeats: int
    flush: CacheFlush | None
    autocast: str | None
    reuse: bool = True
    progress: Callable[[int, int, str], None] | None = None


@dataclass
class _Measured:
    """A measured layer, kept for the later layers with its signature."""

    profile: LayerProfile
    input_saved: list[int]
    output_saved: list[int]
    returns_tuple: bool
    call: nn.Module | None  # the replica, to compute a twin's outputs
    spread: float = 0.0  # of its timed runs, the mean over the batch sizes
    output_grads: list[tuple[bool, ...]] = field(default_factory=list)  # per batch size


def _replica(layer: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``layer`` on ``device``; meta-device state gets storage there, initialized.

    A layer of a model on the meta device is copied without data (a meta copy holds
    none) and materialized alone, so no more than one layer ever has storage.
    """
    replica = copy.deepcopy(layer)
    if has_meta(replica):
        materialize(replica, device)
    return replica.to(device)


def _outputs(
    call: nn.Module,
    inputs: list[Inputs],
    settings: MeasureSettings,
    label: str,
    grads: Sequence[tuple[bool, ...]],
):
    # Under autocast the next layer gets what the model passes it: half-precision outputs.
    with torch.no_grad(), autocast_pass(settings.device.type, settings.autocast):
        raw = [call(*x) for x in inputs]
    # Each output requires a gradient where the measured forward's did (``grads``, per
    # batch size): the next layer's inputs as the model passes them.
    outputs = []
    for out, flags in zip(raw, grads, strict=True):
        plain = as_tensors(out, f"the output of {label}")
        outputs.append(tuple(with_grad(t, g) for t, g in zip(plain, flags, strict=True)))
    return outputs, not isinstance(raw[0], Tensor)


def _measure_one(
    layer: nn.Module,
    name: str,
    inputs: list[Inputs],
    settings: MeasureSettings,
    packed: bool,
    keep: bool,
) -> tuple[_Measured, list[Inputs]]:
    """Measures a replica of ``layer`` at every batch size; keeps the replica if asked."""
    device = settings.device
    replica = _replica(layer, device)
    label = f"layer {name} ({type(layer).__name__})"
    call: nn.Module = OneValue(replica) if packed else replica
    try:
        figures: list[LayerFigures] = []
        for x in inputs:
            try:
                found = measure_layer(
                    call,
                    x,
                    device,
                    warmup=settings.warmup,
                    repeats=settings.repeats,
                    label=label,
                    flush=settings.flush,
                    autocast=settings.autocast,
                    grads=[t.requires_grad for t in x],
                )
            except Exception as exc:
                refusal = batch_refusal(exc, label, x)
                if refusal is None:
                    raise
                raise ValueError(refusal) from None
            figures.append(found)
        grads = [f.output_grads for f in figures]
        outputs, returns_tuple = _outputs(call, inputs, settings, label, grads)
        params = sum(p.numel() * p.element_size() for p in replica.parameters())
        buffers = sum(b.numel() * b.element_size() for b in replica.buffers())
    finally:
        if not keep:
            del replica, call
            call = None  # type: ignore[assignment]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    peaks = [f.peak for f in figures if f.peak is not None]
    profile = LayerProfile(
        name=name,
        kind=type(layer).__name__,
        forward=[f.forward for f in figures],
        backward=[f.backward for f in figures],
        backward_input=[min(f.backward_input, f.backward) for f in figures],
        saved=[f.saved for f in figures],
        gemm_saved=[f.gemm_saved for f in figures],
        output=[tensor_bytes(out) for out in outputs],
        param_bytes=params,
        buffer_bytes=buffers,
        peak=peaks if len(peaks) == len(figures) else None,
    )
    measured = _Measured(
        profile,
        [f.input_saved for f in figures],
        [f.output_saved for f in figures],
        returns_tuple,
        call if keep else None,
        sum(f.spread for f in figures) / len(figures),
        grads,
    )
    return measured, outputs


def measure_layers(
    layers: Sequence[nn.Module],
    names: Sequence[str],
    inputs: list[Inputs],
    settings: MeasureSettings,
    *,
    packed: bool = False,
    signatures: Sequence[str] | None = None,
    spreads: list[float] | None = None,
    needs: Sequence[tuple[int, str]] | None = None,
) -> tuple[list[LayerProfile], list[str]]:
    """Measures each layer on the previous one's outputs, at every batch size.

    A layer with the signature of one measured before (same code, modes, state shapes
    and input shapes: :func:`profiler.pooling.layer_signature`) does the same work; with
    ``settings.reuse`` it takes that layer's figures, and the first one's replica computes its
    outputs for the next layer. Twelve identical blocks are measured once.

    Args:
        layers: the layers; each is copied to the device alone (materialized there when
            its state is on the meta device) and freed after its last twin.
        names: their names.
        inputs: the first layer's inputs at each batch size, on the device.
        settings: the device, how to time, whether to reuse a twin's figures and whom to
            tell the progress.
        packed: the first layer takes its inputs as one tuple.
        signatures: the layers' signatures when known (a count pass computed them);
            ``None``: computed here, on the real inputs.
        spreads: when given, each layer's timing spread (interquartile range of its
            forward and backward runs over their median) is appended to it.
        needs: each layer's counted bytes of measuring it and what they are made of
            (:func:`profiler.memory_guard.measuring_bytes`); a layer is refused before it
            is materialized when the device's free memory is short of them.

    Returns:
        The profiles, each ``shared`` figure set from its predecessor, and the signatures.

    Raises:
        MemoryShortage: a layer to measure does not fit the device's free memory.
    """
    reuse, progress = settings.reuse, settings.progress
    # The first layer's floating inputs get gradients, as a layer inside a model (the
    # figures of a first layer are those of any other); later layers get what the
    # previous one's outputs require.
    inputs = [tuple(with_grad(t, True) for t in x) for x in inputs]
    remaining = Counter(signatures) if signatures is not None else None
    kept: OrderedDict[str, _Measured] = OrderedDict()
    results: list[LayerProfile] = []
    found: list[str] = []
    previous: list[int] | None = None
    for index, (layer, name) in enumerate(zip(layers, names, strict=True)):
        if signatures is not None:
            signature = signatures[index]
        else:
            signature = layer_signature(layer, inputs) + f"#packed={packed}"
        found.append(signature)
        twin = kept.get(signature) if reuse else None
        if twin is not None and twin.call is not None:
            label = f"layer {name} ({type(layer).__name__})"
            measured = twin
            inputs, _ = _outputs(twin.call, inputs, settings, label, twin.output_grads)
            profile = replace(twin.profile, name=name)
        else:
            if needs is not None:
                # Read now, not once: replicas kept for later twins hold memory too.
                label = f"layer {name} ({type(layer).__name__})"
                check_fits(label, *needs[index], settings.device)
            later = remaining is None or remaining[signature] > 1
            measured, inputs = _measure_one(layer, name, inputs, settings, packed, reuse and later)
            profile = measured.profile
            if measured.call is not None:
                kept[signature] = measured
                if remaining is None and len(kept) > _RECENT:
                    kept.popitem(last=False)
        if remaining is not None:
            remaining[signature] -= 1
            if remaining[signature] == 0:
                done = kept.pop(signature, None)
                if done is not None:
                    # Freed now, not when this loop's variables are next assigned: after
                    # the next layer has been materialized beside it.
                    done.call = None
        # The input storages this layer saves that the previous layer saved as its output.
        profile.shared = (
            [0] * len(inputs)
            if previous is None
            else [min(i, p) for i, p in zip(measured.input_saved, previous, strict=True)]
        )
        previous = measured.output_saved
        packed = measured.returns_tuple
        results.append(profile)
        if spreads is not None:
            spreads.append(measured.spread)
        if progress is not None:
            progress(index + 1, len(layers), name)
    kept.clear()
    if settings.device.type == "cuda":
        torch.cuda.empty_cache()
    return results, found
