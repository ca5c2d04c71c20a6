"""ZeRO-2 and ZeRO-3's exchanges per unit and micro-batch, and what of them is exposed.

Over ``S`` devices (the ``D`` replicas times the context-parallel group, over which the
parameters are replicated) a unit's exchange moves ``(S−1)/S · P`` bytes per device
(``P``: its parameter bytes on the device, gradients in the same dtype), plus one
latency. Every unit is one layer of the profile; each exchange runs beside the compute of
the neighbouring unit in the model's order, and only what outlasts that compute is
exposed (added to the layer's pass):

- **ZeRO-2** reduce-scatters each unit's gradients as its backward ends, every
  micro-batch (each device keeps only its share): layer ``j``'s backward overlaps the
  reduce-scatter of layer ``j+1``; the first layer's comes after the last compute, whole.
- **ZeRO-3** also all-gathers each unit's parameters before its forward and its
  backward: layer ``j``'s forward overlaps the gather of ``j+1``, its backward the gather
  of ``j−1`` and the reduce-scatter of ``j+1``; the first layer's forward gather, the
  last layer's backward gather and the first layer's reduce-scatter are whole.

ZeRO-0 and 1 exchange nothing per micro-batch (their gradients are all-reduced, or
reduce-scattered and the parameters gathered, once per step after the pipeline drains;
the cost model's ``allreduce_time``).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.mesh_links import GroupLink

__all__: list[str] = []

Array = NDArray[np.float64]


def unit_exchange(params: Array, shard_over: int, link: GroupLink) -> Array:
    """Seconds of one all-gather (or reduce-scatter) of each unit, per device."""
    if shard_over < 2:
        return np.zeros_like(params)
    moved = (shard_over - 1) / shard_over * params
    return np.where(params > 0, link.seconds(moved, np.ones_like(moved)), 0.0)


def _next(values: Array) -> Array:
    """Row ``j`` holds row ``j+1`` (0 past the last)."""
    out = np.zeros_like(values)
    out[:-1] = values[1:]
    return out


def _previous(values: Array) -> Array:
    """Row ``j`` holds row ``j−1`` (0 before the first)."""
    out = np.zeros_like(values)
    out[1:] = values[:-1]
    return out


def zero_exposed(
    zero: int, params: Array, shard_over: int, link: GroupLink, forward: Array, backward: Array
) -> tuple[Array, Array]:
    """The exposed seconds ZeRO adds to each layer's forward and backward (layers × sizes).

    Args:
        zero: the ZeRO stage (0 to 3).
        params: parameter bytes per layer on one device.
        shard_over: devices the state is sharded over (``S``).
        link: the data-parallel group's link.
        forward: each layer's forward compute, seconds (layers × sizes).
        backward: its backward compute.
    """
    zeros = np.zeros_like(forward)
    if zero < 2 or shard_over < 2 or not len(params):
        return zeros, zeros
    unit = unit_exchange(params, shard_over, link)[:, None] * np.ones_like(forward)
    if zero == 2:
        exposed_bwd = np.maximum(_next(unit) - backward, 0.0)
        exposed_bwd[0] += unit[0]
        return zeros, exposed_bwd
    exposed_fwd = np.maximum(_next(unit) - forward, 0.0)
    exposed_fwd[0] += unit[0]
    exposed_bwd = np.maximum(_previous(unit) + _next(unit) - backward, 0.0)
    exposed_bwd[0] += unit[0]
    exposed_bwd[-1] += unit[-1]
    return exposed_fwd, exposed_bwd
