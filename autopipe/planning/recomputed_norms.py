"""A profile's layers as they run when their normalizations are re-computed in the backward.

Megatron-LM's ``--recompute-granularity selective --recompute-modules layernorm``, and
DeepSeek-V3's training (which re-computes every RMSNorm), keep no normalization's output
for the backward: the operation that saved it (the next projection) gets it back from the
norm's input, which the norm's own backward keeps anyway. Per layer with counted norm
figures (:attr:`profiler.LayerProfile.norm_saved` and the norms' forward work), that is::

    saved'    = saved − norm_saved
    backward' = backward + forward · share,   share = max(norm_flops / flops,
                                                          norm_traffic / traffic)
    peak'     = peak + norm_saved

The backward runs the norms' forward once more before its own (so the input gradient pays
it too); a counted profile's backward FLOPs, traffic and operations grow by the norms'
own, which a target's estimates price again. ``share`` is the norms' part of the layer's
forward by the larger of its FLOPs and bytes moved: norms are memory bound, and where a
layer is a norm alone it is the whole forward. The re-computed outputs are the layer's
``rebuilt`` bytes (:attr:`profiler.LayerProfile.rebuilt`): under a schedule whose
backward runs whole they live again while it runs (``peak``, an upper bound: they are
rebuilt one norm at a time); under one that splits it (``zb``, ``zbv``, ``dualpipev``)
the input gradient's pass re-builds them and they stay until the weights' (whose
projections read them), as re-computed units' activations do
(:mod:`autopipe.planning.schedules.split_holding`): the cost model counts them with the
micro-batches between the two passes, and not in the peak.
Under tensor parallelism the norms' outputs are replicated activations (sequence
parallelism divides them by ``t``), so their bytes leave the shard counts' replicated part.
The figures it has used are dropped (``norm_saved`` and the norms' work ``None``): applied
to its own result it finds nothing left to re-compute, and says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autopipe.planning.pipeline_settings import PipelineSettings
from profiler import LayerProfile, Profile

__all__: list[str] = []


def planned_profile(profile: Profile, settings: PipelineSettings) -> Profile:
    """The profile planning prices under ``settings``: :func:`recomputed_norms` of it with
    ``recompute_norms``, else itself.

    Raises:
        ValueError: as :func:`recomputed_norms`.
    """
    if not settings.recompute_norms:
        return profile
    return recomputed_norms(profile)


def recomputed_norms(profile: Profile) -> Profile:
    """``profile`` with every counted layer's normalization outputs re-computed.

    Raises:
        ValueError: no layer has counted norm figures (a profile counted before they
            were), or none keeps a norm's output (a model without ``LayerNorm`` or
            ``RMSNorm`` modules before a projection).
    """
    counted = [layer.norm_saved for layer in profile.layers if layer.norm_saved is not None]
    if not counted:
        raise ValueError(
            "re-computing the norms needs a profile whose layers count their LayerNorm or "
            "RMSNorm outputs; this one was made before they were counted (or after they "
            "were re-computed): profile the model again (--no-cache)"
        )
    if not any(value > 0 for values in counted for value in values):
        raise ValueError(
            "no layer keeps the output of a LayerNorm or RMSNorm of its own for the backward "
            "(a norm that is a unit by itself, its output saved by the next, stays kept): "
            "there are no norms to re-compute; plan without recompute_norms (--recompute-norms)"
        )
    return dataclasses.replace(profile, layers=[_layer(layer) for layer in profile.layers])


def _share(part: list[float] | None, whole: list[float] | None, j: int) -> float:
    if not part or not whole or whole[j] <= 0:
        return 0.0
    return min(part[j] / whole[j], 1.0)


def _layer(layer: LayerProfile) -> LayerProfile:
    if layer.norm_saved is None:
        return layer
    freed = layer.norm_saved
    n = len(layer.saved)
    share = [
        max(_share(layer.norm_flops, layer.flops, j), _share(layer.norm_traffic, layer.traffic, j))
        for j in range(n)
    ]
    again = [f * s for f, s in zip(layer.forward, share, strict=True)]
    saved = [max(s - f, 0) for s, f in zip(layer.saved, freed, strict=True)]
    changes: dict[str, Any] = {
        "saved": saved,
        "backward": [b + a for b, a in zip(layer.backward, again, strict=True)],
        "rebuilt": [r + f for r, f in zip(layer.rebuilt or [0] * n, freed, strict=True)],
        "norm_saved": None,
        "norm_flops": None,
        "norm_traffic": None,
        "norm_operations": None,
    }
    if layer.shared is not None:  # the input the layer before saves stays a part of it
        changes["shared"] = [min(h, s) for h, s in zip(layer.shared, saved, strict=True)]
    if layer.backward_input is not None:
        changes["backward_input"] = [
            b + a for b, a in zip(layer.backward_input, again, strict=True)
        ]
    if layer.peak is not None:
        changes["peak"] = [p + f for p, f in zip(layer.peak, freed, strict=True)]
    if layer.gemm_saved is not None:  # a norm's output is often a GEMM's input
        changes["gemm_saved"] = [
            max(g - f, 0) for g, f in zip(layer.gemm_saved, freed, strict=True)
        ]
    pairs = (
        ("backward_flops", layer.norm_flops),
        ("backward_input_flops", layer.norm_flops),
        ("backward_traffic", layer.norm_traffic),
        ("backward_operations", layer.norm_operations),
    )
    for name, extra in pairs:
        values = getattr(layer, name)
        if values is not None and extra is not None:
            changes[name] = [v + x for v, x in zip(values, extra, strict=True)]
    if layer.shards is not None:
        changes["shards"] = dataclasses.replace(
            layer.shards,
            replicated_saved=[
                max(r - f, 0) for r, f in zip(layer.shards.replicated_saved, freed, strict=True)
            ],
        )
    return dataclasses.replace(layer, **changes)
