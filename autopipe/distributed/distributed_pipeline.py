"""Runs an autopipe plan over processes, K stages times D replicas, on torch pipelining."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.distributed.prepared import prepare_model
from autopipe.distributed.rank_search import search_prepared
from autopipe.distributed.runner import PipelineRunner
from autopipe.distributed.runtime_calibration import measure_uncached_runtime
from autopipe.distributed.setup import init_distributed
from autopipe.distributed.stage import merge_state_dicts
from autopipe.distributed.virtual import SCHEDULES

__all__ = ["SCHEDULES", "DistributedPipeline", "init_distributed", "merge_state_dicts"]


class DistributedPipeline(PipelineRunner):
    """This rank's stage of a planned pipeline, trained with a torch pipelining schedule.

    Construct it on every rank of an initialised process group with the same arguments.
    The group's K·D ranks run D replicas of a K-stage pipeline, laid out in torchtitan's
    mesh order, the pipeline outermost: rank ``s*D + r`` is stage s of replica r
    (:attr:`stage_index` = rank // D, :attr:`replica_index` = rank % D; with t
    tensor-parallel ranks per stage rank ``(s*D + r)*t + j`` is tensor rank j, see
    :func:`autopipe.distributed.replicas.rank_position`); with D = 1 (the default) every
    rank is one stage. Rank 0 profiles the
    model (unless ``plan`` or ``profile`` is given), plans the split for the schedule's
    memory model, measures the tensors crossing every stage boundary on one micro-batch,
    and broadcasts plan and shapes; every rank then keeps its slice of the model as
    :attr:`module`, on :attr:`device`, under the original parameter names, so an ordinary
    optimizer over ``module.parameters()`` trains it.

    With ``virtual_stages=v`` > 1 the K ranks of a pipeline run K·v interleaved stages,
    :attr:`stage_indices` on this rank, all held by :attr:`module` (see
    :mod:`autopipe.distributed.virtual`); the plan balances the K·v stages and predicts the
    interleaved schedule's step time and memory (:mod:`autopipe.planning.schedules.interleaving`).

    Before anything else the ranks exchange a fingerprint of their arguments (layer and
    parameter names and shapes, chunks, schedule, sample shapes, D, v, the given plan): any
    difference, an invalid argument on any rank, a group size that is not a multiple of D,
    or a plan made for another stage count or D is raised as ``ValueError`` on every rank.
    Waits on other ranks are bounded by the process group's timeout (see
    :func:`init_distributed`).

    Any other model is traced and cut into units by :mod:`autopipe.graph.sequential` (a unit sends
    every tensor live across its cut); its stage keeps the units' own names, while
    :meth:`named_parameters`, :meth:`state_dict` and :meth:`gather_state_dict` use the
    original model's.

    A parameter used by stages on several ranks (a tied embedding and LM head) has a copy on
    each; after every step the copies' gradients are summed over the ranks holding them
    (:class:`autopipe.distributed.tied_gradients.TiedGradients`), so an ordinary optimizer keeps
    them equal. A buffer that units on two ranks use and may write is refused (``ValueError``).

    Replicas (D > 1, see :class:`autopipe.distributed.replicas.ReplicaSync`) start from replica 0's
    state; each step's gradients and floating-point buffers (BatchNorm statistics) are
    averaged over a stage's replicas, so they stay identical. With D > 1 the group must
    span the job (``new_group`` makes the sub-groups).

    The keywords from ``chunks`` on are fields of
    :class:`autopipe.planning.pipeline_settings.PipelineSettings`, laid over ``settings``
    (any other is refused with ``TypeError``); the defaults are decided by
    :meth:`~autopipe.planning.pipeline_settings.PipelineSettings.resolved`.

    Args:
        model: an ``nn.Sequential`` (or a model to auto-wrap); its layers are shared with
            the stages, and this rank's layers are moved to ``device``.
        sample: one mini-batch of inputs, the model's positional inputs as
            ``model(*sample)`` takes them (a tensor is one input; an ``nn.Sequential``
            takes one: ``x`` or ``(x,)``, or ``((a, b),)`` for a first layer that takes a
            tuple), as later passed to :meth:`step`, of at least ``chunks`` rows. A batch
            that is not a multiple of ``chunks`` is split as by ``tensor_split`` (sizes
            ⌈N/M⌉ and ⌊N/M⌋) and the smaller micro-batches are padded to the larger size
            for torch's stages and cut before the loss (:mod:`autopipe.distributed.padding`; not
            for models with BatchNorm). With D > 1 it is the global mini-batch (D·b
            rows, b per replica) when its batch size is a multiple of ``D·chunks``, else
            one replica's shard (b rows); a given plan whose ``batch_size`` is D times
            the sample's marks it as a shard in any case.
        settings: the settings (default: all defaults); ``chunks`` must be set, here or
            as a keyword.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, ``output`` as the model
            returns it; the mini-batch loss and gradients are those of the mean over the
            micro-batches.
        plan: a plan to use instead of planning; its stage count must be K·v (K: the
            group's size divided by D).
        group: the process group (default: the world).
        device: this rank's device (default: the current CUDA device under ``nccl``, else
            the CPU; :func:`autopipe.distributed.collectives.rank_device`).
        profile: a profile to plan from instead of profiling on rank 0.
        chunks: micro-batches per mini-batch (M).
        schedule: ``1f1b`` (default; needs ``chunks >= K``, or with v > 1 chunks a
            multiple of ``max(1, chunks // K)``), ``gpipe`` or ``zb``.
        memory: device capacity for planning (bytes or ``"16GiB"``; one or per stage).
        strategy, optimizer, bandwidth, allreduce_bandwidth, overhead, shard_optimizer:
            as for :func:`autopipe.plan`.
        plan_options: the same settings as a mapping (``strategy``, ``optimizer``,
            ``bandwidth``).
        data_parallel: pipeline replicas (D; default: the plan's ``data_parallel`` when a
            plan is given, else 1). Rank 0 plans for D replicas and the global batch.
        zero: 2 or 3 to shard each stage over its D replicas with torch's
            ``fully_shard``, one FSDP unit per traced unit (ZeRO-2/3,
            :mod:`autopipe.distributed.sharded_replicas`); default: a given plan's
            ``mesh.zero``, else 0. 0 and 1 run plain replicas.
        virtual_stages: stages per rank (v; default 1). With v > 1 rank 0 plans K·v
            stages (``plan(..., virtual_stages=v)``) and the interleaved schedules run
            them; a given plan has K·v stages (made with ``virtual_stages=v`` or not).
        autocast: ``bfloat16`` or ``float16`` to train in mixed precision: rank 0 profiles
            under ``torch.autocast`` (a given profile must have been made so), the stage
            boundaries get the dtypes autocast produces, and :meth:`step` runs under it.
            The stages exchange tensors of the dtypes measured here, so a step under the
            caller's own autocast needs this set to the same dtype.
        checkpoint: re-materialization, as the plan models it: ``never`` (every stage
            keeps its micro-batches' activations), ``always`` (a stage keeps only each
            micro-batch's input and runs its forward again in backward), ``except_last``
            (all but the micro-batch whose backward comes first) or ``auto`` (each stage
            only if it does not fit otherwise, with ``memory``: a stage may then
            re-compute single units, its plan's ``recompute_units``, each on every
            micro-batch; with virtual stages too). Default: ``except_last`` for one stage
            per rank under ``gpipe`` and ``1f1b``, ``never`` with virtual stages and for
            ``zb`` (:func:`autopipe.planning.pipeline_settings.default_checkpoint`). A
            given plan's own modes are used instead, its units included; a plan whose
            stage lists units that are not its own, or re-computes units under ``zbv`` or
            ``dualpipev``, is refused (``ValueError``).
        deferred_batch_norm: update each BatchNorm's running statistics once per step
            from all the inputs it saw: the whole mini-batch, with replicas the global one
            (their counts, means and squared deviations merged exactly), as the plain
            model does; each micro-batch is still normalized with its own statistics.
            ``None`` (default): on when the model has a BatchNorm with running statistics
            and a step splits the batch; ``False`` updates them once per micro-batch (and
            averages them over replicas), with a warning. The model's own modules are not
            converted: the stages run deferred views of them.
        init: for a model built on the meta device (all or partly; each rank builds it
            so, e.g. ``with torch.device("meta"): Model(config)``): after planning, each
            rank gives storage on :attr:`device` to the meta tensors of its own stages only
            (virtual stages each on their own), the other stages' staying on meta, so no
            rank ever holds the whole model. The initializers that exist run on them
            (``reset_parameters``, a Hugging Face model's ``_init_weights``; seeded by the
            stage's index), then ``init(part)``, once per stage with new tensors (not for
            one whose tensors its rank's other stage made already, a tied head): ``part`` is an
            ``nn.Module`` holding exactly that stage's new tensors under the model's names,
            so ``part.load_state_dict(checkpoint, strict=False)`` loads the rank's part of a
            (sharded) checkpoint (``part.state_dict()`` lists its keys; non-persistent
            buffers aside). A tensor no unit uses goes with its module's other tensors.
            A parameter tied across ranks is materialized by each holder; the first
            holder's values are then broadcast to the others, so the copies start equal.
            Without ``init``, a meta tensor that no initializer writes is refused on every
            rank (it would train from placeholder values). Only for a model with meta
            tensors; the model is traced on meta (see :func:`autopipe.graph.trace`) and
            rank 0 profiles its units without their values.
        calibrate: when rank 0 plans from a profile without the runner's calibration and
            this machine's cache has none for the runtime, measure it first, every rank
            together: message latency and bandwidth between ranks and the runner's
            seconds per stage and micro-batch for this schedule and stages per rank
            (:mod:`autopipe.distributed.runtime_calibration`); kept in the cache
            for every later pipeline of the same runtime. Default ``False``: a cached
            entry is still applied, and nothing is measured.

    Raises:
        ValueError: invalid or mismatched arguments, or no plan fits (on every rank).
        RuntimeError: no process group, or another rank failed during setup.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        settings: Any = None,
        *,
        calibrate: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(calibrate, bool):
            raise TypeError(f"calibrate must be True or False, got {calibrate!r}")
        if calibrate:  # a collective once the ranks agree, before rank 0 plans
            self._calibration = measure_uncached_runtime
        super().__init__(model, sample, settings, **kwargs)

    @classmethod
    def from_search(
        cls,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        search_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> DistributedPipeline:
        """A pipeline in the configuration :func:`autopipe.search` ranks first; a collective.

        Rank 0 profiles the model and searches the pipeline depth K and data-parallel width
        D with K·D the group's size, the micro-batches, checkpointing, schedule and (with
        ``virtual_stages`` in ``search_options``) stages per device, among configurations
        that split the batch evenly (:func:`autopipe.distributed.rank_search.search_plan`); every
        rank then builds the pipeline from that plan, of the model traced once.

        Args:
            model: as for the constructor.
            sample: the global mini-batch a step takes.
            loss_fn: as for the constructor.
            group: the process group (default: the world).
            device: this rank's device.
            search_options: for :func:`autopipe.distributed.rank_search.search_plan` (``memory``,
                ``schedules``, ``checkpoints``, ``virtual_stages``, ``calibrate``,
                ``profile``, ``optimizer``, or ``settings`` and ``options`` whole).
            **kwargs: more constructor arguments (``autocast``, ``plan_options`` are not
                searched; ``init`` for a model on the meta device).

        Raises:
            ValueError: no configuration of the group's size fits (on every rank).
        """
        # Traced once, and the plan broadcast once: the search's broadcast gave it to
        # every rank, so building the pipeline shares only the boundary tensors' shapes.
        prepared = prepare_model(model, sample)
        options = dict(search_options or {})
        plan = search_prepared(prepared, group=group, device=device, **options)
        pipe = cls.__new__(cls)
        pipe._handover = (prepared, True)  # traced once; the plan every rank holds
        PipelineRunner.__init__(
            pipe,
            model,
            sample,
            loss_fn=loss_fn,
            chunks=plan.chunks,
            schedule=plan.schedule,
            plan=plan,
            group=group,
            device=device,
            data_parallel=plan.data_parallel,
            virtual_stages=plan.virtual_stages,
            **kwargs,
        )
        return pipe
