"""Data-parallel replicas of a distributed pipeline: rank layout, batch shards, averaging."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from autopipe.distributed.tensor_parallel import local
from autopipe.microbatching import DeferredBatchNorm
from autopipe.planning import Plan

__all__: list[str] = []  # internal to the distributed runner

# Gradients are all-reduced in flat buffers of about this size (DDP's default bucket).
BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class ReplicaLayout:
    """Where one rank sits among D replicas of a K-stage pipeline.

    The ranks are laid out in torchtitan's mesh order, pipeline outermost and the tensor
    dimension innermost (:func:`rank_position`): rank ``(s*D + r)*t + j`` is tensor rank j
    of stage s of replica r, so a stage's D·t ranks are consecutive; the pipeline and
    replica groups join the ranks of one tensor rank j.

    Attributes:
        data_parallel: the number of replicas (D).
        num_stages: stages per pipeline (K).
        stage: this rank's stage.
        replica: this rank's replica.
        pipeline: the group of this replica's K stages (the whole group when D = 1).
        replicas: the group of the D ranks holding this stage (``None`` when D = 1).
        tensor_parallel: ranks per stage sharding its layers (t).
        tensor_mesh: the 1-D device mesh of this stage's t ranks (``None`` when t = 1).
    """

    data_parallel: int
    num_stages: int
    stage: int
    replica: int
    pipeline: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None
    tensor_parallel: int = 1
    tensor_mesh: DeviceMesh | None = None


def rank_position(rank: int, data_parallel: int, tensor_parallel: int = 1) -> tuple[int, int, int]:
    """``(stage, replica, tensor rank)`` of a group rank: torchtitan's mesh order
    (``pp, dp_replicate, dp_shard, cp, tp``, :data:`autopipe.planning.MESH_DIMENSIONS`),
    the pipeline outermost and the tensor dimension innermost, as the planner places the
    groups on nodes (:mod:`autopipe.planning.mesh.mesh_links`)."""
    slot, tensor = divmod(rank, tensor_parallel)
    stage, replica = divmod(slot, data_parallel)
    return stage, replica, tensor


def position_rank(
    stage: int, replica: int, data_parallel: int, tensor: int = 0, tensor_parallel: int = 1
) -> int:
    """The group rank at a position: :func:`rank_position`'s inverse."""
    return (stage * data_parallel + replica) * tensor_parallel + tensor


def data_parallel_problem(value: Any) -> str | None:
    """What is wrong with a ``data_parallel`` argument, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"data_parallel must be a positive integer, got {value!r}"
    return None


def resolve_data_parallel(given: Any, plan: Any, world: int) -> Any:
    """D: ``given``, else the plan's, else 1; checked to be possible for a group of ``world``.

    Raises:
        ValueError: D > 1 on a group that is not every process of the job.
    """
    value = given if given is not None else getattr(plan, "data_parallel", 1)
    if isinstance(value, int) and value > 1 and world != dist.get_world_size():
        raise ValueError(
            f"data_parallel={value} needs a process group of every process (its {world} "
            f"ranks are not the job's {dist.get_world_size()}): new_group makes the sub-groups"
        )
    return value


def check_layout(
    world: int, data_parallel: int, given: int | None, plan: Plan | None, tensor_parallel: int = 1
) -> int:
    """Checks that ``world`` ranks hold ``data_parallel`` replicas of stages of
    ``tensor_parallel`` ranks each; returns the stages (K).

    Args:
        world: ranks in the process group.
        data_parallel: the replicas to run (D).
        given: ``data_parallel`` as passed (``None``: taken from the plan, or 1).
        plan: the given plan, if any.

    Raises:
        ValueError: the plan was made for another D, or ``world`` is not a multiple of D·t.
    """
    if plan is not None and given is not None and plan.data_parallel != given:
        raise ValueError(
            f"the plan was made for data_parallel={plan.data_parallel} but "
            f"data_parallel={given} was given; pass data_parallel={plan.data_parallel} or re-plan"
        )
    if world % data_parallel:
        raise ValueError(
            f"the process group has {world} ranks, not a multiple of data_parallel="
            f"{data_parallel}; launch K·{data_parallel} processes for K stages"
        )
    t = tensor_parallel
    if t > 1 and world % (data_parallel * t):
        raise ValueError(
            f"the process group has {world} ranks, not K·t·D for tensor_parallel={t} and "
            f"data_parallel={data_parallel}; launch a multiple of {t * data_parallel} processes"
        )
    return world // (data_parallel * t)


def group_timeout(group: dist.ProcessGroup | None, device: torch.device) -> timedelta | None:
    """The timeout of ``group`` (default: the world), for the sub-groups made from it."""
    # Sub-groups wait as long as their parent; the backend's options are the only record.
    try:
        parent = group or dist.group.WORLD
        return parent._get_backend(device).options._timeout  # type: ignore[union-attr]
    except Exception:
        return None


def make_layout(
    group: dist.ProcessGroup | None,
    data_parallel: int,
    device: torch.device,
    tensor_parallel: int = 1,
) -> ReplicaLayout:
    """Creates the pipeline and replica sub-groups of ``group``; a collective.

    Every rank of the job creates every sub-group, in the same order (``new_group`` needs
    all of them), so ``group`` must span the job when D > 1 or t > 1. With D = 1 and
    t = 1 no group is made; with t > 1 the groups are those of a (D, K, t) device mesh.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    t = tensor_parallel
    k = world // (data_parallel * t)
    if t > 1:
        return _mesh_layout(data_parallel, k, t, device)
    if data_parallel == 1:
        return ReplicaLayout(1, k, rank, 0, group, None)
    parent: Any = group or dist.group.WORLD
    members = [dist.get_global_rank(parent, i) for i in range(world)]
    options: dict[str, Any] = {"timeout": group_timeout(group, device)}
    d = data_parallel
    pipelines = [dist.new_group(members[r::d], **options) for r in range(d)]
    replicas = [dist.new_group(members[s * d : (s + 1) * d], **options) for s in range(k)]
    stage, replica, _ = rank_position(rank, d)
    return ReplicaLayout(d, k, stage, replica, pipelines[replica], replicas[stage])


def _mesh_layout(d: int, k: int, t: int, device: torch.device) -> ReplicaLayout:
    """The layout of a job of K·D·t ranks as a device mesh ("pp", "dp", "tp"), tp innermost."""
    if dist.get_world_size() != d * k * t:
        raise ValueError(
            f"tensor_parallel={t} needs a process group of every process (the job has "
            f"{dist.get_world_size()}, the pipeline {d * k * t})"
        )
    shape = torch.arange(k * d * t).view(k, d, t)
    mesh = DeviceMesh(device.type, shape, mesh_dim_names=("pp", "dp", "tp"))
    stage, replica, _ = rank_position(dist.get_rank(), d, t)
    replicas = mesh.get_group("dp") if d > 1 else None
    return ReplicaLayout(d, k, stage, replica, mesh.get_group("pp"), replicas, t, mesh["tp"])


def replica_batch(rows: int, data_parallel: int, chunks: int, plan: Plan | None) -> int:
    """The samples per replica (b) implied by a sample of ``rows`` rows.

    The sample is the global mini-batch (b = rows / D) when ``rows`` is a multiple of
    ``D·chunks``, else one replica's shard (b = rows). A given plan whose ``batch_size``
    is ``D·rows`` (and not ``rows``) marks the sample as a shard in any case.
    """
    d = data_parallel
    if d == 1:
        return rows
    planned = plan.batch_size if plan is not None else 0
    if planned == d * rows and planned != rows:
        return rows
    return rows // d if rows % (d * chunks) == 0 else rows


def replica_sample(
    sample: Any, data_parallel: int, chunks: int, plan: Plan | None
) -> tuple[int, Any]:
    """The samples per replica (see :func:`replica_batch`) and replica 0's rows of ``sample``."""
    tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
    b = replica_batch(tensors[0].shape[0], data_parallel, chunks, plan)
    if tensors[0].shape[0] == b:
        return b, sample
    return b, sample[:b] if isinstance(sample, Tensor) else tuple(t[:b] for t in tensors)


def take_shard(value: Any, layout: ReplicaLayout, batch: int, what: str) -> Any:
    """This replica's rows of a step's ``value`` (a tensor or a tuple of tensors).

    A global mini-batch (``D·batch`` rows) gives rows ``[r·batch, (r+1)·batch)`` to
    replica r; a value of ``batch`` rows is this replica's shard already.

    Raises:
        ValueError: another batch size.
    """
    d = layout.data_parallel
    if d == 1 or value is None:
        return value  # one replica: the pipeline checks the size as before
    tensors = (value,) if isinstance(value, Tensor) else value
    if not isinstance(tensors, (tuple, list)) or not all(isinstance(t, Tensor) for t in tensors):
        return value  # not tensors: reported by the size check that follows
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if sizes == {batch}:
        return value
    if sizes == {d * batch}:
        start = layout.replica * batch
        shard = tuple(t[start : start + batch] for t in tensors)
        return shard[0] if isinstance(value, Tensor) else shard
    shapes = [tuple(t.shape) for t in tensors]
    raise ValueError(
        f"{what} must have batch size {d * batch} (the global mini-batch of {d} replicas) or "
        f"{batch} (this replica's shard); got {shapes}"
    )


def _buckets(tensors: Sequence[Tensor], limit: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of tensors with one dtype and device, about ``limit`` bytes each."""
    bucket: list[Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        same = not bucket or (bucket[0].dtype == tensor.dtype and bucket[0].device == tensor.device)
        if bucket and (not same or size + nbytes > limit):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def add_to_earlier(
    params: Sequence[Tensor], earlier: Sequence[Tensor | None], fresh: Sequence[Tensor | None]
) -> None:
    """Sets each parameter's ``.grad`` to what it held before a step plus the step's own.

    A step's collectives reduce only its own gradients (``.grad`` is cleared before it), so
    gradients accumulated over earlier steps without ``zero_grad`` are not reduced again.
    """
    with torch.no_grad():
        for p, old, new in zip(params, earlier, fresh):
            if old is None:
                p.grad = new
            else:
                p.grad = old if new is None else old.add_(new)


def bucketed(
    tensors: Sequence[Tensor], collective: Callable[[Tensor], Any], limit: int = BUCKET_BYTES
) -> None:
    """Runs ``collective(flat)`` on each bucket flattened, then copies ``flat`` back.

    A DTensor (a tensor-parallel shard) takes part by its local values: the ranks of a
    group hold the same shard of it.
    """
    for bucket in _buckets([local(t) for t in tensors], limit):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        collective(flat)
        with torch.no_grad():
            for tensor, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                tensor.copy_(part.view_as(tensor))


def all_reduce_mean(tensors: Sequence[Tensor], group: dist.ProcessGroup, size: int) -> None:
    """Replaces every tensor with its mean over ``group`` (``size`` ranks), in buckets."""

    def mean(flat: Tensor) -> None:
        dist.all_reduce(flat, group=group)  # SUM: AVG is not available on every backend
        flat.div_(size)

    bucketed(tensors, mean)


def _merge_batch_norm(norms: Sequence[DeferredBatchNorm], group: dist.ProcessGroup) -> None:
    """Replaces each layer's gathered statistics with those of every rank of ``group``; a
    collective (the ranks pass their stage's layers in the same order).

    The merge is exact, as if one layer had seen every rank's inputs, not an average of
    running statistics: counts and sums first, giving the global mean, then each rank's
    squared deviations from its own mean plus ``n_r·(mean_r − mean)²``. Every rank ends
    with the same statistics.
    """
    if not norms:
        return
    sizes = [norm.num_features for norm in norms]
    device = next(iter(norms[0].buffers())).device
    counts = torch.zeros(len(norms), dtype=torch.float64, device=device)
    means, m2s = [], []
    for index, norm in enumerate(norms):
        count, mean, m2 = norm.pending()
        zeros = torch.zeros(norm.num_features, dtype=torch.float64, device=device)
        counts[index] = count
        means.append(zeros if mean is None else mean)
        m2s.append(zeros if m2 is None else m2)
    # Counts travel as float64: exact for any count a batch can have.
    sums = torch.cat([counts, *[m * c for m, c in zip(means, counts)]])
    dist.all_reduce(sums, group=group)
    totals = sums[: len(norms)]
    centers = [
        part / max(float(total), 1.0)
        for part, total in zip(sums[len(norms) :].split(sizes), totals)
    ]
    squares = torch.cat(
        [
            m2 + (mean - center) ** 2 * count
            for m2, mean, center, count in zip(m2s, means, centers, counts)
        ]
    )
    dist.all_reduce(squares, group=group)
    for norm, total, center, m2 in zip(norms, totals, centers, squares.split(sizes)):
        count = int(total.item())
        norm.set_pending(count, center if count else None, m2 if count else None)


class ReplicaSync:
    """Keeps one stage's D replicas identical: start state, gradients and buffers.

    * At construction, replica 0's parameters and buffers are broadcast to the others
      (as ``DistributedDataParallel`` does), so replicas start equal whatever their seeds.
    * :meth:`step` wraps one pipeline step: the ``.grad`` accumulated before it is set
      aside, the step's own gradients are averaged over the replicas, and the two are
      added. Averaging only the step's contribution keeps ``.grad`` exactly
      ``earlier + mean(this step)``, as one process would, even where earlier gradients
      differ between replicas. A parameter left without gradient by the step counts as
      zero (it then has a zero ``.grad``, as with DDP).
    * Deferred batch-norm layers
      (:class:`~autopipe.microbatching.batchnorm.DeferredBatchNorm`) commit
      their statistics after each step, merged over the replicas first
      (:func:`_merge_batch_norm`): the running statistics are those of the global
      mini-batch, and equal on every replica. A failed step discards them.
    * Other floating-point buffers (BatchNorm running statistics updated per micro-batch)
      are averaged after each step, so every replica keeps the same statistics, those of
      all the replicas' data. Integer buffers (counters) advance alike on every replica
      and are left alone.

    With one replica (no replica group) only deferred batch-norm layers are committed.

    Args:
        module: this rank's stage.
        layout: the rank layout.
        reduce_gradients: average the gradients over the replicas; ``False`` where the
            stage's sharding reduces them itself (ZeRO-2/3,
            :mod:`autopipe.distributed.sharded_replicas`).
    """

    def __init__(
        self, module: nn.Module, layout: ReplicaLayout, reduce_gradients: bool = True
    ) -> None:
        self.group = layout.replicas
        self.size = layout.data_parallel
        self.params = [p for p in module.parameters() if p.requires_grad and reduce_gradients]
        self.state = [*module.parameters(), *module.buffers()]
        self.norms = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
        merged = {id(b) for norm in self.norms for b in norm.buffers()}
        self.buffers = [
            b for b in module.buffers() if b.is_floating_point() and id(b) not in merged
        ]

    def broadcast_state(self) -> None:
        """Copies replica 0's parameters and buffers to the other replicas; a collective."""
        if self.group is None:
            return
        source = dist.get_global_rank(self.group, 0)
        bucketed(self.state, lambda flat: dist.broadcast(flat, src=source, group=self.group))

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one pipeline step: average its gradients and the buffers afterwards, and
        commit the deferred batch-norm statistics."""
        if self.group is None:
            try:
                yield
            except BaseException:
                self._discard_statistics()
                raise
            for norm in self.norms:
                norm.commit()
            return
        earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
        except BaseException:
            self._discard_statistics()
            add_to_earlier(self.params, earlier, [p.grad for p in self.params])  # no peer listens
            raise
        fresh = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        try:
            all_reduce_mean(fresh, self.group, self.size)
            all_reduce_mean(self.buffers, self.group, self.size)
            _merge_batch_norm(self.norms, self.group)
            for norm in self.norms:
                norm.commit()
        finally:
            self._discard_statistics()  # committed, or never to be: a failed step's
            add_to_earlier(self.params, earlier, fresh)

    def _discard_statistics(self) -> None:
        for norm in self.norms:
            norm.set_pending(0, None, None)

    def mean_loss(self, loss: Tensor) -> Tensor:
        """The mean of ``loss`` over the replicas (the last stage's); a collective."""
        if self.group is None:
            return loss
        loss = loss.clone()
        dist.all_reduce(loss, group=self.group)
        return loss.div_(self.size)
