"""Runs an autopipe plan over processes, one stage per rank, on torch.distributed.pipelining."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from autopipe.dist_setup import (
    LossRecorder,
    batch_tensors,
    check_arguments,
    check_sizes,
    collective,
    default_device,
    fingerprint_settings,
    init_distributed,
    setup_on_rank0,
)
from autopipe.dist_stage import (
    StageModule,
    compare_fingerprints,
    example_tensors,
    fingerprint,
    merge_state_dicts,
)
from autopipe.dist_wrap import original_names, prepare_model
from autopipe.plans import Plan

__all__ = ["SCHEDULES", "DistributedPipeline", "init_distributed", "merge_state_dicts"]

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def _supported(function: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(function).parameters


class DistributedPipeline:
    """This rank's stage of a planned pipeline, trained with a torch pipelining schedule.

    Construct it on every rank of an initialised process group (one stage per rank) with
    the same arguments. Rank 0 profiles the model (unless ``plan`` or ``profile`` is given),
    plans the split for the schedule's memory model, measures the tensors crossing every
    stage boundary on one micro-batch, and broadcasts plan and shapes; every rank then
    keeps its slice of the model as :attr:`module`, on :attr:`device`, under the original
    parameter names, so an ordinary optimizer over ``module.parameters()`` trains it.

    Before anything else the ranks exchange a fingerprint of their arguments (layer and
    parameter names and shapes, chunks, schedule, sample shapes, the given plan): any
    difference, an invalid argument on any rank, or a plan whose stage count is not the
    group's size is raised as ``ValueError`` on every rank. Waits on other ranks are bounded
    by the process group's timeout (see :func:`init_distributed`).

    Any other model is traced and cut into units by :mod:`autopipe.wrapping` (a unit sends
    every tensor live across its cut); its stage keeps the units' own names, while
    :meth:`named_parameters`, :meth:`state_dict` and :meth:`gather_state_dict` use the
    original model's.

    Args:
        model: an ``nn.Sequential`` (or a model to auto-wrap); its layers are shared with
            the stages, and this rank's layers are moved to ``device``.
        sample: one mini-batch of inputs (a tensor or a tuple of tensors, the positional
            inputs), as later passed to :meth:`step`; its batch size must be a multiple of
            ``chunks``.
        loss_fn: ``loss_fn(output, target)`` for one micro-batch, ``output`` as the model
            returns it; the mini-batch loss and gradients are those of the mean over the
            micro-batches.
        chunks: micro-batches per mini-batch (M).
        schedule: ``1f1b`` (default; needs ``chunks >= world size``) or ``gpipe``.
        plan: a plan to use instead of planning; its stage count must be the group's size.
        group: the process group (default: the world).
        device: this rank's device (default: the current CUDA device under ``nccl``, else
            the CPU).
        profile: a profile to plan from instead of profiling on rank 0.
        memory: device capacity for planning (bytes or ``"16GiB"``; one or per stage).
        plan_options: more keyword arguments for :func:`autopipe.plan` (``strategy``,
            ``optimizer``, ``bandwidth``).

    Raises:
        ValueError: invalid or mismatched arguments, or no plan fits (on every rank).
        RuntimeError: no process group, or another rank failed during setup.
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Tensor | tuple[Tensor, ...],
        *,
        loss_fn: Callable[[Any, Any], Tensor],
        chunks: int,
        schedule: str = "1f1b",
        plan: Plan | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        profile: Any = None,
        memory: Any = None,
        plan_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedPipeline needs an initialised process group: call "
                "autopipe.distributed.init_distributed() (or init_process_group) first"
            )
        self.group = group
        self.stage_index = dist.get_rank(group)
        self.num_stages = dist.get_world_size(group)
        self.device = torch.device(device) if device is not None else default_device(group)
        self.chunks = chunks
        self.schedule_name = schedule
        self.batch_size = 0
        self._steps = 0
        self._broken = False
        # Exchange what must agree before anything can hang on a disagreement; a rank with
        # bad arguments still joins, so that every rank raises instead of waiting.
        try:
            self._model = prepare_model(model, sample)
            layers = OrderedDict(self._model.sequential.named_children())
            sample = self._model.sample
            problem = check_arguments(layers, sample, chunks, schedule, loss_fn, plan)
        except ValueError as exc:
            layers, problem = OrderedDict(), str(exc)
        settings = {} if problem else fingerprint_settings(sample, chunks, schedule, plan, profile)
        mine = (problem, fingerprint(layers, **settings) if not problem else {})
        everyone: list[Any] = [None] * self.num_stages
        collective(
            self.stage_index, "compare the ranks' arguments", dist.all_gather_object, everyone, mine
        )
        for rank, (error, _) in enumerate(everyone):
            if error:
                raise ValueError(error if rank == self.stage_index else f"rank {rank}: {error}")
        difference = compare_fingerprints([print_ for _, print_ in everyone])
        if difference:
            raise ValueError(f"the ranks were given different configurations: {difference}")
        check_sizes(self.num_stages, len(layers), plan, schedule, chunks)

        setup: list[Any] = [None]
        failure: BaseException | None = None
        if self.stage_index == 0:
            options = {
                "chunks": chunks,
                "schedule": schedule,
                "memory": memory,
                **(plan_options or {}),
            }
            setup[0], failure = setup_on_rank0(
                self._model.sequential, sample, self.num_stages, self.device, plan, profile, options
            )
        source = dist.get_global_rank(group or dist.group.WORLD, 0)  # type: ignore[arg-type]
        on = self.device if self.device.type == "cuda" else None
        what = "receive the plan from rank 0"
        broadcast = dist.broadcast_object_list
        collective(self.stage_index, what, broadcast, setup, src=source, group=group, device=on)
        error, plan_dict, specs = setup[0]
        if failure is not None:
            raise failure
        if error is not None:
            kind, message = error
            raise (ValueError if kind == "value" else RuntimeError)(
                f"rank 0 could not plan the pipeline: {message}"
            )
        self.plan: Plan = Plan.from_dict(plan_dict)
        self._build(layers, sample, specs, loss_fn, model)

    def _build(
        self,
        layers: OrderedDict[str, nn.Module],
        sample: Any,
        specs: list[Any],
        loss_fn: Any,
        model: nn.Module,
    ) -> None:
        stage = self.plan.stages[self.stage_index]
        names = list(layers)[stage.start : stage.stop]
        tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
        self.batch_size = tensors[0].shape[0]
        if stage.start == 0:
            micro = self.batch_size // self.chunks
            inputs = [((micro, *t.shape[1:]), t.dtype, t.requires_grad) for t in tensors]
            tuple_input = not isinstance(sample, Tensor)
        else:
            inputs, tuple_input = specs[stage.start - 1]
        self.module = StageModule(((n, layers[n]) for n in names), tuple_input=tuple_input)
        self._original = original_names(self.module, model)  # before moving replaces buffers
        self.module.to(self.device)
        self.stage = PipelineStage(
            self.module,
            self.stage_index,
            self.num_stages,
            self.device,
            input_args=example_tensors(inputs, self.device),
            output_args=example_tensors(specs[stage.stop - 1][0], self.device),
            group=self.group,
        )
        if self._model.wrapped:  # the loss sees the model's outputs, not the flat tensors
            rebuild, inner = self._model.rebuild, loss_fn
            loss_fn = lambda out, tgt: inner(rebuild(out, self.module.training), tgt)  # noqa: E731
        self._loss = LossRecorder(loss_fn, self.chunks)
        cls = SCHEDULES[self.schedule_name]
        # Scaling by 1/M in the loss rather than dividing .grad after the step keeps
        # gradients that were accumulated before the step untouched.
        extra: dict[str, Any] = {"scale_grads": False} if _supported(cls, "scale_grads") else {}
        self.schedule = cls(self.stage, self.chunks, loss_fn=self._loss, **extra)
        self._step_extra = (
            {"return_outputs": False} if _supported(cls.step, "return_outputs") else {}
        )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def step(self, inputs: Any = None, target: Any = None) -> Tensor | None:
        """Runs forward and backward of one mini-batch through the pipeline.

        Call it on every rank with the same mini-batch; only the first stage reads
        ``inputs`` and only the last reads ``target`` (others may pass ``None``). Gradients
        are added to the ``.grad`` of :attr:`module`'s parameters, as ``backward`` would.

        Returns:
            On the last rank, the mean of ``loss_fn`` over the micro-batches (detached);
            ``None`` on the other ranks.

        Raises:
            ValueError: a mini-batch of another size than the sample's.
            RuntimeError: a step failed on this or another rank before (the pipeline's
                ranks are out of step then), or the process group timed out.
        """
        if self._broken:
            raise RuntimeError("an earlier step failed; this pipeline cannot run again")
        args = (
            batch_tensors(self._model.flatten(inputs), self.batch_size, self.device, "inputs")
            if self.is_first
            else ()
        )
        kwargs: dict[str, Any] = dict(self._step_extra)
        if self.is_last:
            if isinstance(target, (tuple, list)):
                raise ValueError("target must be a single tensor")
            kwargs["target"] = batch_tensors(target, self.batch_size, self.device, "a target")[0]
        self._loss.values.clear()
        try:
            self.schedule.step(*args, **kwargs)
        except BaseException as exc:
            self._broken = True
            if hasattr(exc, "add_note"):
                exc.add_note(
                    f"autopipe: step {self._steps} failed on rank {self.stage_index} (stage "
                    f"{self.stage_index} of {self.num_stages}); if another rank failed first, "
                    "its log has the cause"
                )
            raise
        self._steps += 1
        return self._loss.mean() if self.is_last else None

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the original model."""
        return [(self._original[k], p) for k, p in self.module.named_parameters()]

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """This rank's part of the original model's ``state_dict`` (its keys)."""
        state: OrderedDict[str, Tensor] = OrderedDict()
        for key, value in self.module.state_dict().items():
            state.setdefault(self._original.get(key, key), value)
        return state

    def gather_state_dict(self, dst: int = 0) -> OrderedDict[str, Tensor] | None:
        """The whole model's ``state_dict`` (on the CPU) on rank ``dst``; ``None`` elsewhere.

        A collective: call it on every rank. The keys are the original model's.
        """
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        parts: list[Any] | None = [None] * self.num_stages if self.stage_index == dst else None
        target = dist.get_global_rank(self.group or dist.group.WORLD, dst)  # type: ignore[arg-type]
        what, gather = "gather the state", dist.gather_object
        collective(self.stage_index, what, gather, state, parts, dst=target, group=self.group)
        return merge_state_dicts(parts) if parts is not None else None

    def __repr__(self) -> str:
        layers = ", ".join(self.module._modules)
        return (
            f"DistributedPipeline(stage {self.stage_index}/{self.num_stages}, layers [{layers}], "
            f"{self.schedule_name}, chunks={self.chunks}, device={self.device})"
        )
