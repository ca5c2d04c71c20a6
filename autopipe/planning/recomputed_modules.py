"""A profile's layers as they run when some of their modules are re-computed in the backward.

Megatron-LM's ``--recompute-granularity selective --recompute-modules ...`` keeps no
output of the named modules for the backward: the operations that saved them get them
back by running the modules once more from what the layer keeps anyway. Two are planned:

- ``layernorm`` (and DeepSeek-V3's training, which re-computes every RMSNorm): each
  normalization's output, re-built from its input, which the norm's own backward keeps;
  counted per layer as :attr:`profiler.LayerProfile.norm_saved` and the norms' work;
- ``mla_up_proj`` (DeepSeek-V3 too): a latent attention's queries, keys and values,
  re-built from the latents by the up-projections, the rotary embedding and the
  concatenation; counted as :attr:`profiler.LayerProfile.up_proj_saved` and that
  region's work (:mod:`profiler.up_projection_counting`).

Per layer with the module's figures (``freed`` bytes, and its forward work)::

    saved'    = saved − freed
    backward' = backward + forward · share,   share = max(flops_m / flops,
                                                          traffic_m / traffic)
    peak'     = peak + freed

The backward runs the module's forward once more before its own (so the input gradient
pays it too); a counted profile's backward FLOPs, traffic and operations grow by the
module's own, which a target's estimates price again. ``share`` is the module's part of
the layer's forward by the larger of its FLOPs and bytes moved: norms are memory bound,
and where a layer is a norm alone it is the whole forward. The re-computed outputs are
the layer's ``rebuilt`` bytes (:attr:`profiler.LayerProfile.rebuilt`): under a schedule
whose backward runs whole they live again while it runs (``peak``, an upper bound: they
are rebuilt one module at a time); under one that splits it (``zb``, ``zbv``,
``dualpipev``) the input gradient's pass re-builds them and they stay until the weights'
(whose projections read them), as re-computed units' activations do
(:mod:`autopipe.planning.schedules.split_holding`): the cost model counts them with the
micro-batches between the two passes, and not in the peak.
Under tensor parallelism the norms' outputs are replicated activations (sequence
parallelism divides them by ``t``), so their bytes leave the shard counts' replicated
part; the attention's queries, keys and values are split by heads, so the up-projections'
leave the sharded part. The figures used are dropped (``None``): applied to its own
result it finds nothing left to re-compute, and says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopipe.planning.pipeline_settings import PipelineSettings
from profiler import LayerProfile, Profile

__all__: list[str] = []


@dataclass(frozen=True)
class RecomputedModule:
    """One kind of module re-computation, as the profile counts it.

    Attributes:
        name: Megatron-LM's name for it (``--recompute-modules``).
        prefix: of the profile's figures, ``{prefix}_saved``, ``_flops``, ``_traffic``
            and ``_operations``.
        replicated: its outputs are replicated activations under tensor parallelism
            (else split with the heads).
        uncounted: the refusal of a profile without its figures.
        nothing: the refusal of a profile where no layer keeps what it makes.
    """

    name: str
    prefix: str
    replicated: bool
    uncounted: str
    nothing: str


_AGAIN = (
    "this one was made before they were counted (or after they were re-computed): "
    "profile the model again (--no-cache)"
)
NORMS = RecomputedModule(
    "layernorm",
    "norm",
    True,
    "re-computing the norms needs a profile whose layers count their LayerNorm or "
    f"RMSNorm outputs; {_AGAIN}",
    "no layer keeps the output of a LayerNorm or RMSNorm of its own for the backward "
    "(a norm that is a unit by itself, its output saved by the next, stays kept): "
    "there are no norms to re-compute; plan without recompute_norms (--recompute-norms)",
)
UP_PROJECTIONS = RecomputedModule(
    "mla_up_proj",
    "up_proj",
    False,
    "re-computing the up-projections needs a profile whose layers count what a latent "
    f"attention's up-projections make; {_AGAIN}",
    "no layer keeps queries, keys or values made by a latent attention's up-projections "
    "(modules named q_b_proj, kv_b_proj, linear_q_up_proj or linear_kv_up_proj) for the "
    "backward: there are none to re-compute; plan without recompute_up_proj "
    "(--recompute-up-proj)",
)


def planned_profile(profile: Profile, settings: PipelineSettings) -> Profile:
    """The profile planning prices under ``settings``: with the norms
    (``recompute_norms``) and the up-projections (``recompute_up_proj``) re-computed as
    asked, else itself.

    Raises:
        ValueError: as :func:`recomputed`.
    """
    if settings.recompute_norms:
        profile = recomputed(profile, NORMS)
    if settings.recompute_up_proj:
        profile = recomputed(profile, UP_PROJECTIONS)
    return profile


def recomputed_norms(profile: Profile) -> Profile:
    """``profile`` with every counted layer's normalization outputs re-computed.

    Raises:
        ValueError: as :func:`recomputed`.
    """
    return recomputed(profile, NORMS)


def recomputed(profile: Profile, module: RecomputedModule) -> Profile:
    """``profile`` with ``module`` re-computed in every layer that counted it.

    Raises:
        ValueError: no layer has the module's figures (a profile counted before they
            were, or after they were re-computed), or none keeps what it makes.
    """
    counted = [
        values
        for layer in profile.layers
        if (values := getattr(layer, f"{module.prefix}_saved")) is not None
    ]
    if not counted:
        raise ValueError(module.uncounted)
    if not any(value > 0 for values in counted for value in values):
        raise ValueError(module.nothing)
    return dataclasses.replace(profile, layers=[_layer(layer, module) for layer in profile.layers])


def _share(part: list[float] | None, whole: list[float] | None, j: int) -> float:
    if not part or not whole or whole[j] <= 0:
        return 0.0
    return min(part[j] / whole[j], 1.0)


def _layer(layer: LayerProfile, module: RecomputedModule) -> LayerProfile:
    prefix = module.prefix
    freed = getattr(layer, f"{prefix}_saved")
    if freed is None:
        return layer
    flops, traffic = getattr(layer, f"{prefix}_flops"), getattr(layer, f"{prefix}_traffic")
    operations = getattr(layer, f"{prefix}_operations")
    n = len(layer.saved)
    share = [
        max(_share(flops, layer.flops, j), _share(traffic, layer.traffic, j)) for j in range(n)
    ]
    again = [f * s for f, s in zip(layer.forward, share, strict=True)]
    saved = [max(s - f, 0) for s, f in zip(layer.saved, freed, strict=True)]
    changes: dict[str, Any] = {
        "saved": saved,
        "backward": [b + a for b, a in zip(layer.backward, again, strict=True)],
        "rebuilt": [r + f for r, f in zip(layer.rebuilt or [0] * n, freed, strict=True)],
        **{f"{prefix}_{what}": None for what in ("saved", "flops", "traffic", "operations")},
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
        ("backward_flops", flops),
        ("backward_input_flops", flops),
        ("backward_traffic", traffic),
        ("backward_operations", operations),
    )
    for name, extra in pairs:
        values = getattr(layer, name)
        if values is not None and extra is not None:
            changes[name] = [v + x for v, x in zip(values, extra, strict=True)]
    if layer.shards is not None:
        part = "replicated_saved" if module.replicated else "saved"
        left = [max(r - f, 0) for r, f in zip(getattr(layer.shards, part), freed, strict=True)]
        shards = dataclasses.replace(layer.shards)
        setattr(shards, part, left)
        changes["shards"] = shards
    return dataclasses.replace(layer, **changes)
