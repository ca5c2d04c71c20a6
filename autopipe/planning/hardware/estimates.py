"""Layer times on a catalog device, estimated from counted FLOPs and bytes (a roofline).

A profile counted on any device (the meta device will do) holds each layer's FLOPs and
memory traffic per pass and micro-batch size. On a device of the catalog, each layer,
pass (forward, backward) and batch size takes::

    t = max(flops / (η_f · peak[dtype]), traffic / (η_m · bandwidth)) + overhead

``peak[dtype]`` is the device's dense peak FLOP/s in the profile's ``autocast`` dtype if
set, else in its ``dtype``; ``bandwidth`` is the device's memory bandwidth; ``η_f`` and
``η_m`` are the shares of those peaks that layers reach, and ``overhead`` the fixed seconds
of a layer pass (its kernels' launches). The input-gradient part of the backward
(``backward_input``, which zero-bubble schedules run apart) gets the FLOPs counted for it
and the backward's traffic in proportion to those FLOPs.

``dtype="float8"`` prices as Megatron's FP8 recipe runs: the linear layers' GEMMs in
float8, attention's scores and weighted sum in bfloat16 (weights and activations stay
bfloat16 in memory, so the traffic is unchanged). Of a pass's FLOPs ``F``, the attention
FLOPs ``A`` of the layer's shard counts (forward ``attention_flops``, backward and its
input-gradient part ``attention_backward_flops``) take the bfloat16 peak::

    t = max((F − A) / (η_f · peak[float8]) + A / (η_f · peak[bfloat16]),
            traffic / (η_m · bandwidth)) + overhead

and ``meta["estimate"]["attention_peak_flops"]`` records that bfloat16 peak. Layers
counted without shard counts (no ``--tp-plan``) tell no attention apart: all their FLOPs
take the float8 peak, and ``meta["estimate"]["note"]`` says how many such layers there
are. :func:`fit_efficiency` fits
``η_f``, ``η_m`` and ``overhead`` to a profile that was both measured and counted, so that a
device one owns calibrates the model for another.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopipe.planning.hardware.device_catalog import CatalogDevice
from autopipe.planning.hardware.efficiency_fit import solve
from autopipe.planning.model.quantities import format_time
from profiler import LayerProfile, Profile

__all__ = ["Efficiency", "estimate_profile", "fit_efficiency"]

# Defaults, for GPUs running PyTorch's eager kernels:
# - η_f 0.55: large matmuls reach 70-80 % of the dense peak, but a layer's pass also runs
#   smaller, less efficient ones (attention's batched products, narrow projections); whole
#   transformer training steps reach 40-60 % of peak (MFU) on A100 and H100.
# - η_m 0.7: elementwise and normalization kernels stream at 60-85 % of the spec-sheet
#   memory bandwidth (a plain copy reaches about 90 %).
# - overhead 5 µs: a kernel launch costs a few µs, and a small layer's pass is bound by
#   them; for large layers the launches overlap the GPU's work, so it matters little.
DEFAULT_COMPUTE = 0.55
DEFAULT_MEMORY = 0.7
DEFAULT_OVERHEAD = 5e-6
# A measured time at or below this is nothing (timer noise, a layer without work): it is
# left out of the fit and of its error, where it would weigh without bound.
NEGLIGIBLE = 1e-7
_COUNTS = ("flops", "backward_flops", "traffic", "backward_traffic")
# The dtype whose GEMMs run at its own peak while attention runs at ATTENTION_DTYPE's.
FP8 = "float8"
ATTENTION_DTYPE = "bfloat16"


@dataclass(frozen=True)
class _Rates:
    """The roofline's peak FLOP/s, bytes/s and, for float8, attention's peak FLOP/s."""

    peak: float
    bandwidth: float
    attention: float | None = None


@dataclass(frozen=True)
class Efficiency:
    """How much of a device's peaks layers reach (see the module's formula).

    Attributes:
        compute: ``η_f``, the share of the peak FLOP/s.
        memory: ``η_m``, the share of the memory bandwidth.
        overhead: fixed seconds per layer and pass.
        fitted: fitted to measurements (:func:`fit_efficiency`), not the defaults.
    """

    compute: float = DEFAULT_COMPUTE
    memory: float = DEFAULT_MEMORY
    overhead: float = DEFAULT_OVERHEAD
    fitted: bool = False

    def __post_init__(self) -> None:
        for what in ("compute", "memory", "overhead"):
            value = getattr(self, what)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if (
                not ok
                or not math.isfinite(value)
                or value < 0
                or (what != "overhead" and not value)
            ):
                bound = ">= 0" if what == "overhead" else "> 0"
                raise ValueError(
                    f"efficiency {what} is {value!r}; it must be a finite number {bound}"
                )

    def to_dict(self) -> dict[str, float]:
        """The three figures, as ``meta["estimate"]["efficiency"]`` records them."""
        return {"compute": self.compute, "memory": self.memory, "overhead": self.overhead}


def compute_dtype(profile: Profile) -> str:
    """The dtype a profile's matmuls ran in: its ``autocast`` dtype, else its ``dtype``."""
    return profile.autocast or profile.dtype


def _check_counted(profile: Profile) -> None:
    for i, layer in enumerate(profile.layers):
        for what in _COUNTS:
            if getattr(layer, what) is None:
                raise ValueError(
                    f"layer {i} ({layer.kind} {layer.name!r}) has no counted {what}: the "
                    "profile was made without counting FLOPs and bytes; profile the model "
                    "with counting on to estimate its times on another device"
                )


def _seconds(
    flops: Sequence[float] | np.ndarray,
    traffic: Sequence[float] | np.ndarray,
    rates: _Rates,
    e: Efficiency,
    attention: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """The formula, per batch size; ``attention``: of ``flops``, those at attention's peak."""
    total = np.asarray(flops, dtype=float)
    if rates.attention is None or attention is None:
        compute = total / (e.compute * rates.peak)
    else:
        part = np.minimum(np.asarray(attention, dtype=float), total)
        compute = (total - part) / (e.compute * rates.peak) + part / (e.compute * rates.attention)
    memory = np.asarray(traffic, dtype=float) / (e.memory * rates.bandwidth)
    return np.maximum(compute, memory) + e.overhead


def _estimated(layer: LayerProfile, rates: _Rates, e: Efficiency) -> LayerProfile:
    assert layer.flops is not None and layer.backward_flops is not None
    assert layer.traffic is not None and layer.backward_traffic is not None
    shards = layer.shards
    forward_attention = shards.attention_flops if shards else None
    # The attention backward is input-gradient work (attention has no weights).
    backward_attention = shards.attention_backward_flops if shards else None
    backward = _seconds(layer.backward_flops, layer.backward_traffic, rates, e, backward_attention)
    part = None
    if layer.backward_input_flops is not None:
        flops = np.asarray(layer.backward_input_flops, dtype=float)
        total = np.asarray(layer.backward_flops, dtype=float)
        # Without weights the input's gradient is the whole backward.
        share = np.divide(flops, total, out=np.ones_like(total), where=total > 0)
        traffic = np.asarray(layer.backward_traffic, dtype=float) * np.minimum(share, 1.0)
        part = np.minimum(_seconds(flops, traffic, rates, e, backward_attention), backward).tolist()
    return dataclasses.replace(
        layer,
        forward=_seconds(layer.flops, layer.traffic, rates, e, forward_attention).tolist(),
        backward=backward.tolist(),
        backward_input=part,
    )


def estimate_profile(
    profile: Profile,
    device: CatalogDevice,
    *,
    efficiency: Efficiency | None = None,
    dtype: str | None = None,
) -> Profile:
    """The profile with its layers' times estimated for a catalog device.

    Counts, bytes and everything else are kept; ``device`` and ``device_name`` become the
    catalog device's key and name, and ``meta["estimate"]`` records the target, the
    efficiency and whether it was fitted. ``meta["calibration"]`` is left out: it
    describes the runner and links of the machine that profiled.

    Args:
        profile: a profile with counted FLOPs and traffic in every layer.
        device: the device to estimate for.
        efficiency: the model's efficiencies; default: :class:`Efficiency`'s.
        dtype: the peak to use, e.g. ``tf32`` for float32 matmuls on tensor cores, or
            ``float8`` for Megatron's FP8 recipe (attention at the bfloat16 peak, see the
            module's docstring); default: :func:`compute_dtype`.

    Raises:
        ValueError: a layer was not counted (the message names the first), or the device
            has no peak for the dtype (for ``float8``: nor for bfloat16).
    """
    _check_counted(profile)
    e = efficiency or Efficiency()
    used = dtype or compute_dtype(profile)
    fp8 = used == FP8
    rates = _Rates(
        device.peak(used),
        device.memory_bandwidth,
        device.peak(ATTENTION_DTYPE) if fp8 else None,
    )
    earlier = profile.meta.get("estimate")  # re-estimated: the counts are still the first's
    counted = earlier.get("counted_on") if isinstance(earlier, dict) else None
    meta = {k: copy.deepcopy(v) for k, v in profile.meta.items() if k != "calibration"}
    meta["estimate"] = {
        "target": device.key,
        "name": device.name,
        "efficiency": e.to_dict(),
        "fitted": e.fitted,
        "dtype": used,
        "counted_on": counted or profile.device_name or profile.device,
        # The roofline's rates, which the mesh's figures re-run on divided counts.
        "peak_flops": rates.peak,
        "memory_bandwidth": rates.bandwidth,
    }
    if fp8:
        meta["estimate"]["attention_peak_flops"] = rates.attention
        unsharded = sum(layer.shards is None for layer in profile.layers)
        if unsharded:
            meta["estimate"]["note"] = (
                f"{unsharded} of {len(profile.layers)} layers have no shard counts, so "
                "their attention FLOPs are priced at the float8 peak too; count the "
                "profile with the model's tensor-parallel plan (--tp-plan) to price "
                "attention at the bfloat16 peak"
            )
    return dataclasses.replace(
        profile,
        layers=[_estimated(layer, rates, e) for layer in profile.layers],
        device=device.key,
        device_name=device.name,
        meta=meta,
    )


@dataclass(frozen=True)
class LayerFit:
    """One layer's estimated and measured forward + backward seconds per batch size.

    Attributes:
        name: the layer's name.
        kind: its class name.
        measured: measured forward + backward seconds per batch size.
        estimated: estimated forward + backward seconds per batch size.
        error: the largest relative error over the batch sizes; ``None`` when the layer
            measured about 0 s at every size (left out).
    """

    name: str
    kind: str
    measured: tuple[float, ...]
    estimated: tuple[float, ...]
    error: float | None


@dataclass(frozen=True)
class EfficiencyFit:
    """The efficiency fitted to a measured profile, and how well it fits.

    Attributes:
        efficiency: the fitted ``η_f``, ``η_m`` and overhead.
        device: the catalog key of the device the profile was measured on.
        median_error: the median of the layers' relative errors.
        max_error: the largest of them.
        layers: per layer, estimated vs measured seconds.
        notes: what the measurements could not tell (e.g. no memory-bound pass).
    """

    efficiency: Efficiency
    device: str
    median_error: float
    max_error: float
    layers: tuple[LayerFit, ...]
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line: the efficiencies and the error, e.g. for a command's output."""
        e = self.efficiency
        compared = [layer for layer in self.layers if layer.error is not None]
        worst = max(compared, key=lambda layer: layer.error or 0.0)
        line = (
            f"fitted on {self.device}: η_f {e.compute:.3g}, η_m {e.memory:.3g}, overhead "
            f"{format_time(e.overhead)} per layer pass; error per layer median "
            f"{self.median_error:.1%}, max {self.max_error:.1%} ({worst.kind} {worst.name!r}), "
            f"over {len(compared)} of {len(self.layers)} layers"
        )
        return "; ".join([line, *self.notes])


def fit_efficiency(
    profile: Profile, device: CatalogDevice, *, dtype: str | None = None
) -> EfficiencyFit:
    """The efficiency whose estimates best match a measured and counted profile.

    Minimizes the relative error of the estimated against the measured forward and
    backward times of every layer and batch size, as ``Σ log(estimated / measured)²``
    (symmetric: half and twice the measurement weigh the same; times of about 0 s left
    out). The error reported per layer is ``|estimated − measured| / measured``.

    Args:
        profile: a profile measured on ``device`` that also holds counts.
        device: the device it was measured on.
        dtype: the peak to use; default: :func:`compute_dtype`.

    Raises:
        ValueError: a layer was not counted, the device has no peak for the dtype, or no
            layer measured more than about 0 s.
    """
    _check_counted(profile)
    used = dtype or compute_dtype(profile)
    peak = device.peak(used)
    x, y, t = [], [], []
    for layer in profile.layers:
        passes = (
            (layer.forward, layer.flops, layer.traffic),
            (layer.backward, layer.backward_flops, layer.backward_traffic),
        )
        for times, flops, traffic in passes:
            assert flops is not None and traffic is not None
            for seconds, f, m in zip(times, flops, traffic):
                if seconds > NEGLIGIBLE:
                    x.append(f / peak)
                    y.append(m / device.memory_bandwidth)
                    t.append(seconds)
    if not t:
        raise ValueError(
            "no layer of the profile measured more than about 0 s; fit on a measured profile"
        )
    default = (DEFAULT_COMPUTE, DEFAULT_MEMORY, DEFAULT_OVERHEAD)
    found, notes = solve(np.array(x), np.array(y), np.array(t), default)
    e = Efficiency(*found, fitted=True)
    layers = tuple(
        _compare(layer, estimated)
        for layer, estimated in zip(
            profile.layers, estimate_profile(profile, device, efficiency=e, dtype=used).layers
        )
    )
    errors = [layer.error for layer in layers if layer.error is not None]
    return EfficiencyFit(
        efficiency=e,
        device=device.key,
        median_error=float(np.median(errors)),
        max_error=float(max(errors)),
        layers=layers,
        notes=tuple(notes),
    )


def _compare(measured: LayerProfile, estimated: LayerProfile) -> LayerFit:
    real = [f + b for f, b in zip(measured.forward, measured.backward)]
    guess = [f + b for f, b in zip(estimated.forward, estimated.backward)]
    errors = [abs(g - r) / r for g, r in zip(guess, real) if r > NEGLIGIBLE]
    return LayerFit(
        name=measured.name,
        kind=measured.kind,
        measured=tuple(real),
        estimated=tuple(guess),
        error=max(errors) if errors else None,
    )
