"""A rank's stages of a distributed pipeline: one, or v virtual stages for interleaved schedules.

With ``virtual_stages=v`` a pipeline of K ranks runs K·v stages; the rank at pipeline
position k holds stages ``k, k+K, k+2K, ...`` (torch's "looped" mapping, which
``PipelineStage`` and the interleaved schedules assume by default). The rank holding stage
0 is position 0 and the one holding stage K·v−1 is position K−1, so which rank reads the
inputs and which the targets is the same as without virtual stages.

``1f1b`` runs as torch's ``ScheduleInterleaved1F1B`` and ``gpipe`` as
``ScheduleLoopedBFS``. Rank 0 plans K·v stages with ``virtual_stages=v``: the split
balances the K·v stages, and the plan predicts the interleaved step time and each stage's
micro-batches in flight under these schedules (:mod:`autopipe.planning.schedules.interleaving`).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from autopipe.distributed.stage import StageModule, TensorSpec, example_tensors
from autopipe.distributed.v_stages import V_SCHEDULES, is_v_schedule
from autopipe.planning import Plan, spared

__all__: list[str] = []

SCHEDULES: dict[str, type[PipelineScheduleSingle]] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# Multi-stage counterparts: all of a rank's stages in one schedule, in the same spirit
# (all forwards first, or one forward one backward in the steady state).
VIRTUAL_SCHEDULES: dict[str, type[PipelineScheduleMulti]] = {
    "gpipe": ScheduleLoopedBFS,
    "1f1b": ScheduleInterleaved1F1B,
    # Zero bubble: backwards split into the input's and the weights' gradients, the
    # latter run when the rank would wait; runs on the multi-stage runtime for any v.
    "zb": ScheduleInterleavedZeroBubble,
}


def virtual_problem(value: Any) -> str | None:
    """What is wrong with a ``virtual_stages`` argument, or ``None``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"virtual_stages must be a positive integer, got {value!r}"
    return None


def stage_indices(position: int, ranks: int, virtual: int) -> list[int]:
    """The stages of the rank at pipeline ``position`` of ``ranks``: ``position + i·ranks``."""
    return [position + i * ranks for i in range(virtual)]


def check_virtual(ranks: int, virtual: int, schedule: str, chunks: int) -> None:
    """Checks torch's constraints of the interleaved schedules (and zero bubble's).

    ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` run the micro-batches
    in ``max(1, M // K)`` rounds of equal size, so M must be a multiple of that;
    ``ScheduleLoopedBFS`` takes any M.

    Raises:
        ValueError: the schedule cannot run ``chunks`` micro-batches on ``ranks`` ranks.
    """
    if schedule == "gpipe" or (virtual == 1 and schedule == "1f1b"):
        return
    rounds = max(1, chunks // ranks)
    if chunks % rounds:
        name = "zero bubble" if schedule == "zb" else "interleaved 1f1b"
        raise ValueError(
            f"{name} runs chunks in rounds of about K micro-batches and needs chunks "
            f"to be a multiple of the number of rounds (chunks // K = {rounds}); got chunks="
            f"{chunks} for K={ranks} ranks (use a multiple of {ranks}, or schedule='gpipe')"
        )


class RankStages(nn.Module):
    """The container of one rank's virtual stages (children ``stage<index>``).

    It exists so that one module holds all of the rank's layers: ``parameters()`` feeds an
    optimizer, ``state_dict()`` saves them. It has no ``forward`` of its own: its stages
    are not consecutive, and the schedule runs each one separately.
    """

    def __init__(self, stages: Mapping[int, StageModule]) -> None:
        super().__init__()
        for index, stage in stages.items():
            self.add_module(f"stage{index}", stage)

    def layer_names(self) -> list[str]:
        """The names of the layers of every stage, in stage order."""
        return [name for stage in self.children() for name in stage._modules]


def _stage_module(
    layers: Mapping[str, nn.Module],
    plan: Plan,
    index: int,
    sample: Any,
    specs: Sequence[Any],
    micro: int,
    chunks: int,
    spared: int,
) -> tuple[StageModule, Sequence[TensorSpec]]:
    """Stage ``index``'s module and the specs of its input tensors (one micro-batch)."""
    stage = plan.stages[index]
    names = list(layers)[stage.start : stage.stop]
    if stage.start == 0:
        tensors = (sample,) if isinstance(sample, Tensor) else tuple(sample)
        inputs = [((micro, *t.shape[1:]), t.dtype, t.requires_grad) for t in tensors]
        tuple_input = not isinstance(sample, Tensor)
    else:
        inputs, tuple_input = specs[stage.start - 1]
    module = StageModule(
        ((n, layers[n]) for n in names),
        tuple_input=tuple_input,
        checkpoint=stage.checkpoint or plan.checkpoint,
        chunks=chunks,
        spared=spared,
        # The plan counts units in the model; the stage, among its own layers.
        units=[unit - stage.start for unit in stage.recompute_units],
    )
    return module, inputs


def _first_backward(ranks: int, virtual: int, chunks: int, schedule: str, stage: int) -> int:
    """The micro-batch whose backward torch's schedule runs first on ``stage``: the first
    under ScheduleGPipe, Schedule1F1B and interleaved 1F1B, the last under looped BFS."""
    if (virtual == 1 and schedule in SCHEDULES) or is_v_schedule(schedule):
        return 0  # V schedules re-compute nothing (v_stages.check_v_sizes)
    return spared(ranks, virtual, chunks, schedule)[stage]


def build_stages(
    layers: Mapping[str, nn.Module],
    plan: Plan,
    indices: Sequence[int],
    sample: Any,
    specs: Sequence[Any],
    micro: int,
    chunks: int,
    schedule: str,
) -> tuple[nn.Module, list[tuple[int, StageModule, Sequence[TensorSpec], Sequence[TensorSpec]]]]:
    """This rank's module and, per stage, its index, module and input and output specs.

    Args:
        layers: the model's layers by name.
        plan: the plan (its stage count is the number of virtual stages, K·v).
        indices: this rank's stages (one, or v for interleaved schedules).
        sample: one replica's sample, as the first layer takes it.
        specs: per layer, the specs of its output on one micro-batch and whether it is a
            tuple (:func:`autopipe.distributed.stage.layer_output_specs`).
        micro: samples per micro-batch.
        chunks: micro-batches per step (a stage re-computes them as the plan's
            ``checkpoint`` says, or with ``units`` its ``recompute_units`` on each).
        schedule: ``gpipe`` or ``1f1b``: with ``except_last`` a stage spares the
            micro-batch whose backward the schedule runs first.

    Returns:
        The rank's module, a :class:`StageModule` for one stage and a :class:`RankStages`
        of them for several, and the stages.
    """
    stages = []
    ranks = plan.num_stages // len(indices)
    for index in indices:
        first = _first_backward(ranks, len(indices), chunks, schedule, index)
        module, inputs = _stage_module(layers, plan, index, sample, specs, micro, chunks, first)
        outputs = specs[plan.stages[index].stop - 1][0]
        stages.append((index, module, inputs, outputs))
    if len(stages) == 1:
        return stages[0][1], stages
    return RankStages(OrderedDict((index, module) for index, module, *_ in stages)), stages


def make_schedule(
    name: str,
    stages: Sequence[tuple[int, StageModule, Sequence[TensorSpec], Sequence[TensorSpec]]],
    num_stages: int,
    device: torch.device,
    group: dist.ProcessGroup | None,
    chunks: int,
    loss_fn: Any,
) -> tuple[Any, list[PipelineStage], dict[str, Any]]:
    """The ``PipelineStage`` of every stage and the schedule that runs them.

    Args:
        name: ``gpipe`` or ``1f1b``; with several stages their interleaved counterparts.
        stages: from :func:`build_stages`, with the modules moved to ``device``.
        num_stages: stages of the whole pipeline (K·v).
        device: this rank's device.
        group: the pipeline's process group (its K ranks).
        chunks: micro-batches per mini-batch.
        loss_fn: the per-micro-batch loss, already scaled by 1/M.

    Returns:
        The schedule, the pipeline stages, and the keyword arguments for its ``step``.
    """
    pipeline_stages = [
        PipelineStage(
            module,
            index,
            num_stages,
            device,
            input_args=example_tensors(inputs, device),
            output_args=example_tensors(outputs, device),
            group=group,
        )
        for index, module, inputs, outputs in stages
    ]
    single = len(pipeline_stages) == 1 and name in SCHEDULES
    tables: dict[str, Any] = SCHEDULES if single else {**VIRTUAL_SCHEDULES, **V_SCHEDULES}
    cls: type[Any] = tables[name]
    # Scaling by 1/M in the loss rather than dividing .grad after the step keeps
    # gradients that were accumulated before the step untouched.
    extra: dict[str, Any] = {"scale_grads": False} if _supported(cls, "scale_grads") else {}
    target: Any = pipeline_stages[0] if single else pipeline_stages
    schedule = cls(target, chunks, loss_fn=loss_fn, **extra)
    step_extra = {"return_outputs": False} if _supported(cls.step, "return_outputs") else {}
    return schedule, pipeline_stages, step_extra


def _supported(function: Any, name: str) -> bool:
    return name in inspect.signature(function).parameters


def stage_states(
    module: nn.Module,
    indices: Sequence[int],
    original: Mapping[str, str],
    whole: Callable[[Tensor], Tensor] | None = None,
) -> list[tuple[int, OrderedDict[str, Tensor]]]:
    """Each stage's ``state_dict`` on the CPU under the original model's keys, by index.

    Args:
        module: the rank's module, from :func:`build_stages`.
        indices: its stages.
        original: the module's ``state_dict`` keys to the original model's.
        whole: makes each value whole before it moves to the CPU (a tensor-parallel
            shard's gather, a collective), or ``None``.
    """
    if isinstance(module, RankStages):
        modules = [(i, f"stage{i}.", module.get_submodule(f"stage{i}")) for i in indices]
    else:
        modules = [(indices[0], "", module)]
    states = []
    for index, prefix, stage in modules:
        state: OrderedDict[str, Tensor] = OrderedDict()
        for key, value in stage.state_dict(prefix=prefix).items():
            value = value if whole is None else whole(value)
            state.setdefault(original.get(key, key), value.detach().cpu())
        states.append((index, state))
    return states
