"""The runner's figures a cost model is built with: links, all-reduce and executor overhead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopipe.planning.model.cost_model import CostModel, CostOptions
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.layer_costs import LayerCosts, calibrated_figures
from autopipe.planning.model.quantities import parse_rate
from profiler import Profile

__all__ = []


@dataclass(frozen=True)
class RunnerFigures:
    """What the runner adds to the layers' own costs, given or calibrated for a profile.

    :func:`autopipe.plan` and :func:`autopipe.search` both build their cost models through
    :meth:`cost_model`, so the same arguments value a configuration alike in both.

    Attributes:
        bandwidth: bytes/s of the link between stages, or ``None`` (free).
        latency: seconds per message between stages.
        allreduce_bandwidth: bytes/s of the gradient all-reduce, or ``None`` (free).
        overhead: executor seconds per stage and micro-batch.
        virtual_overhead: the same for the runtime of virtual stages and zero bubble, when
            it was given or measured apart (else ``overhead`` holds for it too).
    """

    bandwidth: float | None = None
    latency: float = 0.0
    allreduce_bandwidth: float | None = None
    overhead: float = 0.0
    virtual_overhead: float | None = None

    @classmethod
    def resolve(
        cls,
        profile: Profile,
        *,
        bandwidth: float | str | None = None,
        allreduce_bandwidth: float | str | None = None,
        overhead: float | None = None,
    ) -> RunnerFigures:
        """The given figures, with the profile's calibrated ones for those not given.

        Args:
            profile: the profile whose ``meta["calibration"]`` fills in.
            bandwidth: link bytes/s (or a rate such as ``10GB/s``).
            allreduce_bandwidth: all-reduce bytes/s (default: the calibrated one, else
                ``bandwidth``).
            overhead: executor seconds per stage and micro-batch, for every runtime.

        Raises:
            ValueError: a rate that is not positive or does not parse.
        """
        measured = calibrated_figures(profile)
        link = measured.get("bandwidth") if bandwidth is None else parse_rate(bandwidth)
        if allreduce_bandwidth is None:
            allreduce = measured.get("allreduce_bandwidth", link)
        else:
            allreduce = parse_rate(allreduce_bandwidth, "allreduce_bandwidth")
        if overhead is not None:
            return cls(link, measured.get("latency_s", 0.0), allreduce, overhead, overhead)
        return cls(
            link,
            measured.get("latency_s", 0.0),
            allreduce,
            measured.get("overhead_s", 0.0),
            measured.get("virtual_overhead_s"),
        )

    @property
    def replayed_overhead(self) -> float:
        """Seconds per stage and micro-batch on the runtime torch uses for virtual stages and
        zero bubble: measured apart when calibrated for it, else ``overhead``."""
        return self.overhead if self.virtual_overhead is None else self.virtual_overhead

    def overhead_for(self, virtual_stages: int, schedule: str) -> float:
        """Seconds per stage and micro-batch of the runtime that runs the schedule."""
        if virtual_stages > 1 or schedule == "zb":
            return self.replayed_overhead
        return self.overhead

    def cost_model(
        self,
        costs: LayerCosts,
        devices: Sequence[DeviceSpec],
        chunks: int,
        checkpoint: str,
        schedule: str,
        optimizer: float,
        options: CostOptions | None = None,
    ) -> CostModel:
        """The cost model of ``devices`` (one per stage) running ``costs`` with these figures.

        Args:
            costs: the layers' costs at the micro-batch size.
            devices: one device per stage (K·v with virtual stages).
            chunks: micro-batches per mini-batch of one replica.
            checkpoint: the checkpoint mode.
            schedule: the pipeline schedule.
            optimizer: optimizer state bytes per parameter byte.
            options: the replicas, virtual stages, sharding and colocation; their
                ``overhead`` and ``allreduce_bandwidth`` are these figures'.
        """
        given = options if options is not None else CostOptions()
        return CostModel(
            costs,
            list(devices),
            chunks,
            checkpoint,
            schedule,
            optimizer,
            replace(
                given,
                overhead=self.overhead_for(given.virtual_stages, schedule),
                allreduce_bandwidth=self.allreduce_bandwidth,
            ),
        )
