"""ZeRO-2 and ZeRO-3's exchanges per unit and micro-batch, and what of them is exposed.

Over ``S`` devices (the ``D`` replicas times the context-parallel group, over which the
parameters are replicated) a unit's exchange moves ``(S−1)/S · P`` bytes per device
(``P``: its parameter bytes on the device, gradients in the same dtype) in the ``S − 1``
steps of a ring, each paying the link's latency: NCCL runs all-gathers and
reduce-scatters as rings, so over thousands of devices the latencies, not the bytes, can
outlast a layer's compute (why practice shards over a node or a few rather than over
every replica). Every unit is one layer of the profile; each exchange runs beside the compute of
the neighbouring unit *of the same stage* in the model's order (the units of the next
stage run on another device, which hides nothing here), and only what outlasts that
compute is exposed. For a stage of layers ``[s, e)``:

- **ZeRO-2** reduce-scatters each unit's gradients as its backward ends, every
  micro-batch (each device keeps only its share): layer ``j``'s backward overlaps the
  reduce-scatter of layer ``j+1``; the stage's first layer's comes after its last
  compute, whole.
- **ZeRO-3** also all-gathers each unit's parameters before its forward and its
  backward: layer ``j``'s forward overlaps the gather of ``j+1``, its backward the gather
  of ``j−1`` and the reduce-scatter of ``j+1`` (both in one window on the one link);
  the stage's first forward gather (of ``s``), first backward gather (of ``e−1``) and
  last reduce-scatter (of ``s``) are whole: before them the device runs other
  micro-batches' passes of its own, whose units' exchanges are not done yet, so
  nothing hides them.

A stage's exposure depends on where it starts and ends, so it is not a sum of per-layer
figures: :class:`StageExchanges` gives it per span, and the cost model adds it to the
stage's passes (:class:`autopipe.planning.model.cost_model.CostModel`), which the replayed
schedules then place as any other compute. ZeRO-0 and 1 exchange nothing per micro-batch
(their gradients are all-reduced, or reduce-scattered and the parameters gathered, once
per step after the pipeline drains; the cost model's ``allreduce_time``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.mesh.mesh_links import GroupLink

__all__: list[str] = []

Array = NDArray[np.float64]
Index = NDArray[np.int64] | int


def unit_exchange(
    params: Array, shard_over: int, link: GroupLink, steps: Array | None = None
) -> Array:
    """Seconds of one ring all-gather (or reduce-scatter) of each unit, per device.

    Args:
        params: bytes per unit whose exchange over ``shard_over`` devices it takes.
        shard_over: ``S``.
        link: the ring's link.
        steps: the ring steps per unit (default ``S − 1``; a unit of experts sharded over
            their own replicas runs a second ring).
    """
    if shard_over < 2:
        return np.zeros_like(params)
    moved = (shard_over - 1) / shard_over * params
    if steps is None:
        steps = np.full_like(moved, shard_over - 1.0)
    return np.where(params > 0, link.seconds(moved, steps), 0.0)


def _windows(exchanged: Array, compute: Array) -> Array:
    """Prefix sums (length L + 1) of what outlasts each layer's compute of the exchange
    beside it, ``max(exchanged[j] − compute[j], 0)``."""
    return np.concatenate([[0.0], np.cumsum(np.maximum(exchanged - compute, 0.0))])


@dataclass(frozen=True)
class StageExchanges:
    """ZeRO-2/3's exposed exchanges of a stage at one micro-batch size (see the module
    docstring).

    Attributes:
        zero: the ZeRO stage (2 or 3).
        unit: each layer's exchange, seconds (:func:`unit_exchange`).
        forward: each layer's forward compute at this size, seconds.
        backward: its backward compute.
    """

    zero: int
    unit: Array
    forward: Array
    backward: Array
    _sums: dict[str, Array] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The prefix sums every span reads, once per profile and size (the search asks
        # for thousands of spans of each).
        u = self.unit
        previous = np.concatenate([[0.0], u[:-1]])
        following = np.concatenate([u[1:], [0.0]])
        windows = {
            "ahead": _windows(u[1:], self.forward[:-1]),
            "tail": _windows(u[1:], self.backward[:-1]),
            "previous": previous,
            "following": following,
            "interior": _windows(previous + following, self.backward),
        }
        object.__setattr__(self, "_sums", windows)

    def exposed(self, s: Index, e: Index) -> tuple[Array, Array]:
        """Seconds the exchanges add to the forward and to the backward of one
        micro-batch of a stage of layers ``[s, e)`` (``s < e``; arrays broadcast)."""
        u, sums = self.unit, self._sums
        s, e = np.asarray(s), np.asarray(e)
        first = u[s]
        if self.zero == 2:
            # Backward: layer j < e−1 hides the reduce-scatter of j+1.
            tail = sums["tail"]
            return np.zeros(np.shape(first * e)), first + tail[e - 1] - tail[s]
        # Forward: layer j > s waits for its gather beyond layer j−1's forward.
        ahead = sums["ahead"]  # [i]: layers 1 .. i
        forward = first + ahead[np.maximum(e - 1, 0)] - ahead[s]
        # Backward, ZeRO-3: the gather of e−1 and the reduce-scatter of s whole; layer j's
        # window carries the gather of j−1 and the reduce-scatter of j+1 inside the stage.
        n = len(u)
        previous, following, interior = sums["previous"], sums["following"], sums["interior"]
        last = u[np.maximum(e - 1, 0)]
        multi = e - s >= 2
        head = np.maximum(following[s] - self.backward[s], 0.0)
        end = np.minimum(e - 1, n - 1)
        tail_window = np.maximum(previous[end] - self.backward[end], 0.0)
        middle = interior[np.maximum(e - 1, s + 1)] - interior[np.minimum(s + 1, n)]
        windows = np.where(multi, head + tail_window + np.maximum(middle, 0.0), 0.0)
        return forward, last + first + windows
