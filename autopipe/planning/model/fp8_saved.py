"""Saved bytes under an FP8 recipe: the weight GEMMs' activation inputs in one byte each.

Megatron's FP8 recipe (Transformer Engine) and DeepSeek-V3 save the input of every linear
layer's GEMM quantized to FP8 for its weight gradient. A profile whose estimate prices
``float8`` (``meta["estimate"]["dtype"]``) therefore holds, of each layer's saved bytes,
its ``gemm_saved`` (:attr:`profiler.LayerProfile.gemm_saved`) at one byte per element
instead of the compute dtype's ``s`` bytes::

    saved' = saved − gemm_saved · (1 − 1/s)

Everything else a layer saves stays in its dtype: attention's queries, keys, values and
output, norms' and activations' inputs; weights and their gradients too. The reduction
is a factor ``saved'/saved`` per layer and batch size, which the saved bytes' tensor- and
context-parallel parts (:mod:`autopipe.planning.mesh.degree_figures`) and the routed
experts' share take alike. The bytes a layer shares with the one before it lose the
layer's whole ``gemm_saved``: a shared storage that a GEMM takes is held in full by the
layer before and in FP8 by this one (never more shared than that, so memory is never
under-counted). Profiles without the figure (older ones) plan as before.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from profiler import Profile

__all__: list[str] = []

Array = NDArray[np.float64]

FP8 = "float8"
# Bytes per element of the dtypes a profile's matmuls run in.
_ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def fp8_estimate(profile: Profile) -> bool:
    """Whether the profile's times were estimated for the FP8 recipe."""
    found = profile.meta.get("estimate") if isinstance(profile.meta, dict) else None
    return isinstance(found, dict) and found.get("dtype") == FP8


def element_bytes(profile: Profile) -> int | None:
    """Bytes per element of the dtype the profile's matmuls ran in (its ``autocast``
    dtype, else its ``dtype``), ``None`` when unknown."""
    return _ELEMENT_BYTES.get(profile.autocast or profile.dtype)


def gemm_savings(profile: Profile) -> Array | None:
    """The bytes FP8 saves of each layer's saved bytes (layers × batch sizes), ``None``
    when the profile is no float8 estimate or no layer counted its GEMM inputs."""
    size = element_bytes(profile)
    if not fp8_estimate(profile) or size is None or size <= 1:
        return None
    layers = profile.layers
    if all(layer.gemm_saved is None for layer in layers):
        return None
    zeros = [0.0] * len(profile.batch_sizes)
    gemm = np.array([layer.gemm_saved or zeros for layer in layers], dtype=float)
    return gemm * (1.0 - 1.0 / size)


def saved_factor(profile: Profile) -> Array | None:
    """``saved'/saved`` per layer and batch size (1 where nothing is saved), ``None``
    when nothing changes (see :func:`gemm_savings`)."""
    savings = gemm_savings(profile)
    if savings is None:
        return None
    saved = np.array([layer.saved for layer in profile.layers], dtype=float)
    kept = np.maximum(saved - savings, 0.0)
    return np.where(saved > 0, kept / np.where(saved > 0, saved, 1.0), 1.0)


def shared_fp8(profile: Profile, shared: Array) -> Array:
    """The bytes each layer shares with the one before it, less its GEMM inputs (which it
    holds in FP8 beside the earlier layer's copy); ``shared`` unchanged when the profile
    plans as before."""
    if gemm_savings(profile) is None:
        return shared
    zeros = [0.0] * len(profile.batch_sizes)
    gemm = np.array([layer.gemm_saved or zeros for layer in profile.layers], dtype=float)
    return np.asarray(np.maximum(shared - gemm, 0.0))
