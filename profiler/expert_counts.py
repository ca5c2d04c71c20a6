"""What of a mixture-of-experts layer expert parallelism divides, and what it sends.

Counted with the layer's other figures on fake tensors, where the router's choices are
not values but an assumption: balanced top-k by default (each routed expert receives
``tokens * top_k / experts`` tokens), or a skew (the busiest expert receives ``skew``
times the mean). The planner derives from it each layer's figures at any expert-parallel
degree ``e``: the routed experts' parameters, gradients and optimizer state divided by
``e``, the all-to-all dispatch and combine of the routed tokens, and the straggler's
time under skew.

Every list holds one figure per batch size of the profile, like the layer's own figures;
the router, shared experts and everything outside the routed experts are the layer's
ordinary (replicated) figures.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Any

from profiler.shard_counts import check_figures, read_record

__all__ = ["ExpertCounts"]


@dataclass
class ExpertCounts:
    """One layer's routed experts, as expert parallelism sees them.

    Attributes:
        experts: routed experts per mixture-of-experts block.
        top_k: experts each token is sent to.
        blocks: mixture-of-experts blocks in the layer (0 for none).
        param_bytes: of the layer's parameter bytes, those of the routed experts (what
            ``e`` devices each hold ``1 / e`` of).
        flops: of the forward's FLOPs, those of the routed experts (all of the layer's
            routed tokens, at the assumed routing).
        backward_flops: the same for the backward.
        backward_input_flops: of ``backward_flops``, those of the input's gradient.
        saved: of the layer's saved bytes, those the routed experts save.
        dispatch_bytes: bytes of the routed token copies per forward (``tokens * top_k``
            rows of the hidden size, summed over the blocks): what the dispatch
            all-to-all sends, and again the combine; the backward sends the same.
        skew: the assumption counted with: the busiest expert receives ``skew`` times
            the mean of the routed tokens (1.0: balanced).
        traffic: of the forward's memory traffic, the routed experts' as a grouped
            kernel moves it, each expert on its own rows (``None`` in profiles written
            before it was counted: then their FLOPs' share of the layer's).
        backward_traffic: the same for the backward.
        weight_traffic: of ``traffic``, what does not follow the tokens (the experts'
            weights read): what a device holding ``1/e`` of the experts moves ``1/e`` of.
        backward_weight_traffic: the same for the backward (weights read, their
            gradients written and accumulated).
        groups: equal groups of experts the router first chooses among (DeepSeek's
            ``n_group``; 1: no group limit).
        top_groups: groups each token's experts come from (``topk_group``): expert
            parallelism that places whole groups on nodes sends a token to at most this
            many nodes.
    """

    experts: int
    top_k: int
    blocks: int
    param_bytes: int
    flops: list[float]
    backward_flops: list[float]
    backward_input_flops: list[float]
    saved: list[int]
    dispatch_bytes: list[int]
    skew: float = 1.0
    groups: int = 1
    top_groups: int = 1
    traffic: list[float] | None = None
    backward_traffic: list[float] | None = None
    weight_traffic: list[float] | None = None
    backward_weight_traffic: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: object, where: str, n: int) -> ExpertCounts:
        """Reads and validates one layer's record (``where`` names it, ``n`` batch sizes).

        Raises:
            ValueError: a field is missing, unknown, or not a finite figure >= 0 (one per
                batch size where it is a list); ``skew`` below 1.
        """
        made = read_record(cls, data, where)
        made.check(where, n)
        return made

    def check(self, where: str, n: int) -> None:
        """Every figure is finite and >= 0; lists hold one figure per batch size; the
        expert and top-k counts are integers with ``1 <= top_k <= experts``; skew >= 1;
        ``1 <= top_groups <= groups``, ``groups`` dividing ``experts``."""
        check_figures(self, where, n)
        for name in ("experts", "top_k", "blocks", "groups", "top_groups"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral):
                raise ValueError(f"{where}.{name} is {value!r}; it must be an integer")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"{where}.top_k is {self.top_k}; it must lie in 1..experts ({self.experts})"
            )
        if not 1 <= self.top_groups <= self.groups or self.experts % self.groups:
            raise ValueError(
                f"{where}: top_groups {self.top_groups} of groups {self.groups} must lie in "
                f"1..groups, and the groups must divide the experts ({self.experts})"
            )
        if self.skew < 1:
            raise ValueError(
                f"{where}.skew is {self.skew}; the busiest expert's share of the mean must be >= 1"
            )
