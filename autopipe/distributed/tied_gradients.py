"""Parameters used by stages on several ranks: a copy on each, their gradients summed per step."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.replicas import (
    ReplicaLayout,
    add_to_earlier,
    bucketed,
    group_timeout,
    position_rank,
)
from profiler import tensor_uses

__all__: list[str] = []  # internal to the distributed runner


@dataclass
class _Use:
    """A tensor of the layers and where it is used."""

    tensor: Tensor
    name: str  # its name in the first layer using it, for messages
    layer: int
    parameter: bool
    stages: set[int]
    positions: set[int]


def _uses(
    layers: Sequence[nn.Module], balance: Sequence[int], ranks: int | Sequence[int]
) -> list[_Use]:
    """Every parameter and buffer of the layers, in order of first use, with its stages and
    pipeline positions: stage ``s`` runs on position ``s % ranks`` (torch's looped mapping),
    or ``ranks[s]`` when ``ranks`` gives every stage's position (the V schedules')."""
    stage_of = [stage for stage, size in enumerate(balance) for _ in range(size)]
    where = list(ranks) if isinstance(ranks, Sequence) else [s % ranks for s in range(len(balance))]
    found = []
    for use in tensor_uses(layers[: len(stage_of)]):
        stages = {stage_of[k] for k in use.layers}
        found.append(
            _Use(
                use.tensor,
                use.names[0],
                use.layers[0],
                not use.buffer,
                stages,
                {where[stage] for stage in stages},
            )
        )
    return found


def shared_state(
    layers: Sequence[nn.Module],
    balance: Sequence[int],
    ranks: int | Sequence[int] | None = None,
    written: Collection[int] | None = None,
) -> str | None:
    """Names a buffer that layers on two ranks use and may write, or ``None``.

    Each rank holds its own copy of what its layers use. A parameter's copies stay equal
    (:class:`TiedGradients` sums their gradients), and so do a buffer's that is only
    read; a buffer written in place by one rank's layers would differ from the other
    ranks' copies.

    Args:
        layers: the model's layers.
        balance: layers per stage.
        ranks: ranks per pipeline (K; default: one stage per rank), or every stage's
            pipeline position.
        written: ``id`` of the buffers some layer may write (default: every buffer, when
            the model's code is not known).
    """
    for use in _uses(layers, balance, len(balance) if ranks is None else ranks):
        if use.parameter or len(use.positions) < 2:
            continue
        if written is None or id(use.tensor) in written:
            stages = sorted(use.stages)
            return (
                f"buffer {use.name} of layer {use.layer} is used by stages "
                f"{', '.join(map(str, stages))} on different ranks and may be written in "
                "place: its copies on the ranks would differ, so choose a split (plan) that "
                "keeps its users on one rank"
            )
    return None


def written_shared(
    layers: Sequence[nn.Module], written: Collection[int] | None, owner: nn.Module
) -> set[str]:
    """Every name in ``owner`` of the buffers that several layers use and may write.

    Each rank holds a copy of what its stages use, so the planner keeps the users of these
    on one stage (:func:`autopipe.planning.model.cut_rules.keep_together`); with virtual stages
    too, though a rank's stages could share one.

    Args:
        layers: the model's layers.
        written: ``id`` of the buffers some layer may write (``None``: every buffer).
        owner: the model whose names the profile gives tied tensors.
    """
    ids = {
        id(use.tensor)
        for use in _uses(layers, [1] * len(layers), len(layers))
        if not use.parameter
        and len(use.stages) > 1
        and (written is None or id(use.tensor) in written)
    }
    return {name for name, t in owner.named_buffers(remove_duplicate=False) if id(t) in ids}


def shared_across_stages(
    layers: Sequence[nn.Module], balance: Sequence[int], ranks: int | Sequence[int]
) -> list[tuple[Tensor, tuple[int, ...]]]:
    """The tensors that several stages use, with their pipeline positions, in first use
    (``ranks``: K, or every stage's position)."""
    return [
        (use.tensor, tuple(sorted(use.positions)))
        for use in _uses(layers, balance, ranks)
        if len(use.stages) > 1
    ]


def make_tie_groups(
    ties: Sequence[tuple[Tensor, tuple[int, ...]]],
    layout: ReplicaLayout,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> dict[tuple[int, ...], dist.ProcessGroup | None]:
    """This rank's process group for each set of positions holding copies of a parameter;
    a collective over the job when a set is not the whole pipeline.

    ``new_group`` is called by every rank of the job for every set and replica, in the same
    order (sets sorted, then replicas), so the groups match on every rank; a set of every
    position is the pipeline's own group.

    Raises:
        ValueError: a set needs a new group but ``group`` is not every process of the job.
    """
    k, d = layout.num_stages, layout.data_parallel
    sets = sorted({positions for _, positions in ties if len(positions) > 1})
    mine: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    world = dist.get_world_size(group)
    parent: Any = group or dist.group.WORLD
    members = [dist.get_global_rank(parent, i) for i in range(world)]
    options: dict[str, Any] = {"timeout": group_timeout(group, device)}
    for positions in sets:
        if len(positions) == k:
            if layout.stage in positions:
                mine[positions] = layout.pipeline
            continue
        if world != dist.get_world_size():
            raise ValueError(
                f"a parameter is used by stages on ranks {list(positions)} of the pipeline, "
                f"whose gradients are summed in a group of those ranks, but the process group "
                f"has {world} of the job's {dist.get_world_size()} ranks: new_group needs every "
                "process of the job; pass the world group"
            )
        for replica in range(d):
            ranks = [members[position_rank(p, replica, d)] for p in positions]
            made = dist.new_group(ranks, **options)
            if replica == layout.replica and layout.stage in positions:
                mine[positions] = made
    return mine


def _summed(group: dist.ProcessGroup | None) -> Callable[[Tensor], None]:
    def total(flat: Tensor) -> None:
        dist.all_reduce(flat, group=group)

    return total


class TiedGradients:
    """Sums the gradients of a parameter's copies over the ranks holding them, per step.

    A parameter used by stages on several ranks (a tied embedding and LM head) has a copy
    on each; the copies start equal (each rank builds its stages from the same model). The
    plain model's parameter receives the sum of its users' gradients, so after each step
    every copy's gradient is replaced by the sum over the copies, in a group of exactly
    the ranks holding them (Megatron-LM's embedding group): any ordinary optimizer then
    keeps the copies equal. On one rank, stages using the same parameter share one tensor,
    whose gradient accumulates locally.

    As for replicas, only the step's own gradient is summed: the ``.grad`` accumulated
    before the step is set aside and added back, so accumulation without ``zero_grad``
    stays exact. A copy left without gradient by the step counts as zero.

    Args:
        ties: the parameters that several stages use, with their pipeline positions, in the
            same order on every rank (:func:`shared_across_stages`).
        groups: this rank's group for each set of positions (:func:`make_tie_groups`).
        position: this rank's pipeline position.
    """

    def __init__(
        self,
        ties: Sequence[tuple[Tensor, tuple[int, ...]]],
        groups: Mapping[tuple[int, ...], dist.ProcessGroup | None],
        position: int,
    ) -> None:
        by_set: dict[tuple[int, ...], list[Tensor]] = {}
        for tensor, positions in ties:
            held = position in positions and len(positions) > 1
            if held and isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                by_set.setdefault(positions, []).append(tensor)
        # Sets in sorted order on every rank: two ranks sharing two groups use them alike.
        self.parts = [(groups[s], by_set[s]) for s in sorted(by_set)]
        self.params = [p for _, params in self.parts for p in params]

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one pipeline step: sum its gradients over each parameter's copies."""
        if not self.params:
            yield
            return
        earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
        except BaseException:
            add_to_earlier(self.params, earlier, [p.grad for p in self.params])  # no peer listens
            raise
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        try:
            for group, params in self.parts:
                bucketed([p.grad for p in params if p.grad is not None], _summed(group))
        finally:
            add_to_earlier(self.params, earlier, [p.grad for p in self.params])
