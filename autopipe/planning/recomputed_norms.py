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
layer is a norm alone it is the whole forward. The re-computed outputs live again while
the layer's backward runs (``peak``, an upper bound: they are rebuilt one norm at a time).
Under tensor parallelism the norms' outputs are replicated activations (sequence
parallelism divides them by ``t``), so their bytes leave the shard counts' replicated part.
Only schedules that run each backward whole are priced so (:func:`check_schedules`). The
figures it has used are dropped (``norm_saved`` and the norms' work ``None``): applied
to its own result it finds nothing left to re-compute, and says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autopipe.planning.pipeline_settings import PipelineSettings
from autopipe.planning.schedules.split_holding import SPLIT_SCHEDULES
from profiler import LayerProfile, Profile

__all__: list[str] = []


def planned_profile(profile: Profile, settings: PipelineSettings) -> Profile:
    """The profile planning prices under ``settings``: :func:`recomputed_norms` of it with
    ``recompute_norms``, else itself.

    Raises:
        ValueError: as :func:`recomputed_norms`, or ``recompute_norms`` under a schedule
            that splits the backward (:func:`check_schedules`).
    """
    if not settings.recompute_norms:
        return profile
    if settings.schedule is not None:
        check_schedules([settings.schedule])
    return recomputed_norms(profile)


def check_schedules(schedules: Sequence[str]) -> list[str]:
    """The schedules the norms' re-computation is priced under: those that run each
    backward whole.

    Under split backward (``zb``, ``zbv``, ``dualpipev``) the weights' gradients run after
    the input's and need the norms' outputs again: re-built for the input's gradient, they
    stay until the weights' (the bytes freed hold only until the input's gradient, as for
    re-computed units), which these figures, freed for the whole backward, do not price.

    Raises:
        ValueError: none of ``schedules`` runs its backward whole.
    """
    whole = [s for s in schedules if s not in SPLIT_SCHEDULES]
    if not whole:
        raise ValueError(
            f"re-computing the norms is planned under schedules whose backward runs whole; "
            f"{', '.join(schedules)} split it (the weights' gradients need the norms' "
            "outputs again): use gpipe or 1f1b, or plan without recompute_norms"
        )
    return whole


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
