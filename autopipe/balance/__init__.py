"""torchgpipe's balancers: measure each layer of an ``nn.Sequential``, then split it optimally.

``balance_by_time`` and ``balance_by_size`` take torchgpipe's arguments and measure what
torchgpipe measures, but split the measured costs with autopipe's exact partitioner (the
split whose largest partition is smallest); ``strategy="blockpartition"`` gives
torchgpipe's own heuristic instead. ``autopipe.balance.blockpartition.solve`` is
torchgpipe's function of that name, on the same strategy.

Each name below loads its module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from profiler import lazy_face

if TYPE_CHECKING:
    from autopipe.balance.balancers import balance_by_size, balance_by_time
    from autopipe.balance.layer_measures import layer_sizes, layer_times, layerwise_sandbox

__all__ = [
    "balance_by_size",
    "balance_by_time",
    "layer_sizes",
    "layer_times",
    "layerwise_sandbox",
]

_HOMES = {
    "balance_by_size": "autopipe.balance.balancers",
    "balance_by_time": "autopipe.balance.balancers",
    "layer_sizes": "autopipe.balance.layer_measures",
    "layer_times": "autopipe.balance.layer_measures",
    "layerwise_sandbox": "autopipe.balance.layer_measures",
}

if not TYPE_CHECKING:
    __getattr__, __dir__ = lazy_face(__name__, _HOMES)
