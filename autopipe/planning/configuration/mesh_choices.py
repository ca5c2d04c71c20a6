"""The mesh configurations of :func:`autopipe.search`: ``t·c·K·D`` equal to the devices.

Searching tensor (t), context (c) or sharded data parallelism (a ZeRO stage) besides the
pipeline (K) and its replicas (D), every configuration takes all ``N`` devices (a mesh
that leaves devices idle is not what a cluster runs), and with a micro-batch size ``b``
the global batch ``B`` fixes the micro-batches: ``M = B / (D·b)`` (a ``D`` that does not
divide ``B / b`` is left out). Degrees ``t`` are those every layer's heads allow
(:meth:`autopipe.planning.mesh.shard_table.ShardTable.refusal`), up to the devices of one
node unless listed; sequence parallelism goes with ``t > 1``; a ZeRO stage above 0 with
``D·c > 1``; an expert-parallel degree ``e`` (profiles with routed experts only) with
``e`` dividing ``D·c`` and every block's expert count
(:mod:`autopipe.planning.mesh.expert_figures`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autopipe.planning.configuration.search_space import Bounds, Config, variants

__all__: list[str] = []


@dataclass(frozen=True)
class MeshChoices:
    """What the mesh search weighs.

    Attributes:
        tensor: tensor-parallel degrees.
        context: context-parallel degrees.
        sequence_parallel: sequence parallelism off and/or on (with ``t > 1``).
        zero: ZeRO stages.
        micro_batch: samples per micro-batch, or ``None``: every size the batch allows.
        expert: expert-parallel degrees to weigh, each where the rule allows it.
        experts: the greatest common divisor of the blocks' routed experts, 0 for a
            profile without routed experts (then only ``e = 1``).
    """

    tensor: Sequence[int] = (1,)
    context: Sequence[int] = (1,)
    sequence_parallel: Sequence[bool] = (False,)
    zero: Sequence[int] = (0,)
    micro_batch: int | None = None
    expert: Sequence[int] = (1,)
    experts: int = 0

    def expert_degrees(self, ranks: int) -> list[int]:
        """The expert-parallel degrees of :attr:`expert` the rule allows over ``ranks``
        (``D·c``) devices."""
        if not self.experts:
            return [1] if 1 in self.expert else []
        return [e for e in self.expert if ranks % e == 0 and self.experts % e == 0]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def mesh_configurations(bounds: Bounds, choices: MeshChoices) -> list[Config]:
    """Every configuration of exactly ``bounds.devices`` devices (see the module docstring)."""
    n_devices, batch, out = bounds.devices, bounds.batch, []
    for t in choices.tensor:
        for c in choices.context:
            if n_devices % (t * c):
                continue
            rest = n_devices // (t * c)
            for k in (k for k in _divisors(rest) if k <= bounds.layers):
                d = rest // k
                if d > batch:
                    continue
                replica = -(-batch // d)
                if choices.micro_batch is not None:
                    mb = choices.micro_batch
                    if batch % (d * mb):
                        continue
                    options = [(batch // (d * mb), mb)]
                else:
                    options = bounds.chunks(replica, k)
                degrees = choices.expert_degrees(d * c)
                for sp in choices.sequence_parallel:
                    if sp and t == 1:
                        continue
                    # Sharding over a single replica shards nothing: there every stage
                    # listed is ZeRO-0 (the configuration kept, once).
                    zeros = choices.zero if d * c > 1 else (0,)
                    for zero in zeros:
                        for e in degrees:
                            for m, micro in options:
                                point = Config(
                                    k, d, m, micro, "never", "gpipe", replica, 1, t, c, sp,
                                    zero, e,
                                )  # fmt: skip
                                out.extend(variants(point, bounds))
    return out


def tensor_degrees(
    given: Sequence[int], allowed: Callable[[int], bool], per_node: int
) -> list[int]:
    """The tensor-parallel degrees to search: ``given``, or (empty) every degree up to one
    node's devices (8 when unknown) that ``allowed`` accepts (the heads divide)."""
    if given:
        return list(given)
    return [t for t in _divisors(per_node or 8) if allowed(t)]
