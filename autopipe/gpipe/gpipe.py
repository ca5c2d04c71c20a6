"""GPipe: pipeline-parallel training of an ``nn.Sequential`` in one process (torchgpipe's API)."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from autopipe.gpipe.colocated import colocation_mismatch, device_groups
from autopipe.gpipe.fill_drain import Pipeline
from autopipe.gpipe.microbatch import TensorOrTensors, check, gather, scatter
from autopipe.gpipe.recomputed_units import (
    UNITS,
    RecomputedUnits,
    plan_recomputation,
    recompute_lists,
)
from autopipe.gpipe.tied_copies import Replicas
from autopipe.microbatching import DeferredBatchNorm
from autopipe.planning import FIXED_CHECKPOINT_MODES
from profiler import resolve_device, stage_devices

if TYPE_CHECKING:
    from autopipe.planning import Plan

__all__ = ["GPipe", "verify_module"]

Device = torch.device | str | int


def _moving_denied() -> TypeError:
    return TypeError(
        "a GPipe model is spread over its devices; it cannot be moved to a single device "
        "(dtype conversions with .to(dtype) are allowed)"
    )


def refuse_device_move(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    error: Callable[[], TypeError] = _moving_denied,
) -> None:
    """Raises ``error()`` if ``.to(*args, **kwargs)`` would move a module to a device."""
    if "device" in kwargs or "tensor" in kwargs:
        raise error()
    if args and isinstance(args[0], (torch.device, str, int, torch.Tensor)):
        raise error()


def verify_module(module: nn.Module) -> None:
    """Checks that ``module`` can be split into partitions (torchgpipe's check).

    Args:
        module: the model to split.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: it holds the same layer more than once.
    """
    if not isinstance(module, nn.Sequential):
        kind = type(module).__name__
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {kind}")
    layers = list(module._modules.values())
    if len({id(layer) for layer in layers}) != len(layers):
        raise ValueError(
            "module with duplicate children is not supported: the module holds the same "
            "layer more than once; give each position its own layer"
        )


def _modes(checkpoint: object) -> list[str]:
    """The checkpoint modes ``checkpoint`` names: one for all partitions, or one each."""
    wrong = ValueError(
        "checkpoint is not one of 'always', 'except_last', or 'never' (nor 'units' with "
        f"recompute=, nor a list of one per partition): got {checkpoint!r}"
    )
    if isinstance(checkpoint, str):
        modes = [checkpoint]
    elif isinstance(checkpoint, (list, tuple)):
        modes = list(checkpoint)
    else:
        raise wrong
    known = (*FIXED_CHECKPOINT_MODES, UNITS)
    if any(not isinstance(mode, str) or mode not in known for mode in modes):
        raise wrong
    return modes


def _validate(
    module: nn.Module,
    balance: Iterable[int] | None,
    chunks: int,
    checkpoint: object,
    recompute: object,
) -> tuple[list[int], list[list[int]]]:
    verify_module(module)
    if balance is None:
        raise ValueError(
            "balance is required: the layers per partition, e.g. from "
            "autopipe.balance.balance_by_time(partitions, module, sample) or autopipe.partition"
        )
    balance = list(balance)
    if not balance:
        raise ValueError("balance must have at least one partition")
    if any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
        raise ValueError(f"balance entries must be integers, got {balance}")
    if any(b < 1 for b in balance):
        raise ValueError(f"every partition needs at least one layer; balance is {balance}")
    layers = len(module._modules)
    if sum(balance) != layers:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the module has {layers} "
            "layers; autopipe.balance.balance_by_time finds a balance that fits"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    modes = _modes(checkpoint)
    if not isinstance(checkpoint, str) and len(modes) != len(balance):
        raise ValueError(
            f"checkpoint has {len(modes)} modes but there are {len(balance)} partitions"
        )
    if isinstance(checkpoint, str):
        modes = modes * len(balance)
    return balance, recompute_lists(recompute, modes, balance)


def _resolve_devices(devices: Sequence[Device] | None, partitions: int) -> list[torch.device]:
    if devices is None:
        return stage_devices(partitions)
    resolved = [
        torch.device("cuda", d) if isinstance(d, int) else resolve_device(d) for d in devices
    ]
    if len(resolved) < partitions:
        raise ValueError(f"{partitions} partitions need {partitions} devices, got {len(resolved)}")
    return resolved[:partitions]


class GPipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe's micro-batch pipeline.

    The layers are split into consecutive partitions of ``balance`` layers, each moved to its
    device. A forward call splits the mini-batch into ``chunks`` micro-batches along dim 0,
    runs micro-batch ``i`` on partition ``j`` at clock ``i + j``, and returns the
    concatenated output on the last device; backward runs the micro-batches in reverse.

    The layers keep their names: ``state_dict()`` has the keys of the original module, so
    checkpoints load into either. Use :meth:`close` (or ``with``) to stop the worker
    threads early; they also stop when the object is garbage-collected.

    Args:
        module: the model; its layers are moved to their devices in place.
        balance: layers per partition; must sum to ``len(module)``. Required (``None``
            is refused); :mod:`autopipe.balance` measures one.
        devices: one device per partition (extra ones are ignored). Defaults to the visible
            GPUs round-robin, or to the CPU for every partition when there is none
            (:func:`profiler.devices.stage_devices`).
        chunks: micro-batches per mini-batch.
        checkpoint: which micro-batches recompute activations in backward: ``always``,
            ``except_last`` (all but the last) or ``never``; or ``units``: the layers that
            ``recompute`` lists for the partition, each on every micro-batch. One mode for
            every partition or one per partition (as a plan with ``checkpoint="auto"``
            chooses them).
        recompute: for partitions of mode ``units``, the layers to re-compute: one list
            per partition of positions within it (``[[0, 2], []]``: the first and third
            layers of partition 0), empty for the partitions of other modes. Each listed
            layer runs under activation checkpointing on every training micro-batch: it
            keeps only its input and runs its forward again in backward, with the random
            numbers of its first run, updating batch-norm statistics once. Required
            exactly when a partition has mode ``units``; :meth:`from_plan` passes a plan's
            ``recompute_units``.
        deferred_batch_norm: update batch-norm running statistics once per mini-batch, from
            all of its samples, instead of once per micro-batch.
        replicate_shared: give every later partition using a shared tensor a copy even
            when it is on the owner's device (for testing the replicated path on one
            device); by default only partitions on other devices get one.

    A parameter or buffer that layers of several partitions use (a tied embedding and LM
    head) stays with the first of them; each later partition on another device reads a
    copy on its own device, made afresh from it at every forward. A parameter's copy is
    differentiable, so the parameter receives the sum of all its copies' gradients, as in
    the plain module; the module's ``parameters()`` and ``state_dict()`` hold it once.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: an argument is invalid, there are too few devices, or a tensor used on
            several devices cannot be replicated (a shared batch norm's running statistics).
    """

    balance: list[int]
    devices: list[torch.device]
    chunks: int
    checkpoint: str | list[str]
    recompute: list[list[int]]

    def __init__(
        self,
        module: nn.Sequential,
        balance: Iterable[int] | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: str | Sequence[str] = "except_last",
        recompute: Sequence[Sequence[int]] | None = None,
        deferred_batch_norm: bool = False,
        replicate_shared: bool = False,
    ) -> None:
        super().__init__()
        balance, units = _validate(module, balance, chunks, checkpoint, recompute)
        # Checked before anything is moved or converted, so a rejected module is left as is.
        reserved = {*self.__dict__, "balance", "devices", "chunks", "checkpoint", "recompute"}
        for name in module._modules:
            if name in reserved or hasattr(type(self), name):
                raise ValueError(f"layer name {name!r} clashes with a GPipe attribute")
        self.devices = _resolve_devices(devices, len(balance))
        self.balance = balance
        self.chunks = chunks
        self.checkpoint = checkpoint if isinstance(checkpoint, str) else list(checkpoint)
        self.recompute = units
        if deferred_batch_norm:
            DeferredBatchNorm.convert(module)
        layers = list(module._modules.items())
        partitions: list[nn.Sequential] = []
        start = 0
        for size, positions, device in zip(self.balance, units, self.devices, strict=True):
            own = OrderedDict(layers[start : start + size])
            if positions:
                partitions.append(RecomputedUnits(own, positions, device))
            else:
                partitions.append(nn.Sequential(own))
            start += size
        names = {
            id(t): n
            for n, t in reversed(
                [
                    *module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False),
                ]
            )
        }
        replicas = Replicas(partitions, self.devices, names, force=replicate_shared)
        with replicas.moving(partitions):
            for part, device in zip(partitions, self.devices):
                part.to(device)
        # The layers are registered under their own names so that state_dict() matches the
        # plain module; the partitions share those layers but are kept out of the module tree
        # so that nothing is listed twice.
        for name, layer in layers:
            self.add_module(name, layer)
        object.__setattr__(self, "_partitions", nn.ModuleList(partitions))
        object.__setattr__(self, "_pipeline", None)
        object.__setattr__(self, "_replicas", replicas)

    @classmethod
    def from_plan(cls, module: nn.Sequential, plan: Plan, **kwargs: Any) -> GPipe:
        """Builds a GPipe with the balance, devices, chunks and checkpoint mode of ``plan``.

        A stage planned to re-compute single units (checkpoint ``units``, from
        ``checkpoint="auto"``) re-computes exactly its ``recompute_units``. Extra keyword
        arguments (e.g. ``deferred_batch_norm``) are passed on. Partitions on one physical
        device take turns on it; a plan that does not record them so (``plan.shared``,
        from ``colocated=True``) mispredicts the step, which is warned of.
        """
        if plan.schedule != "gpipe":
            warnings.warn(
                f"the plan was made for the {plan.schedule!r} schedule; GPipe runs fill-drain, "
                "which holds more activations than the plan predicts",
                stacklevel=2,
            )
        if plan.virtual_stages > 1:
            warnings.warn(
                f"the plan interleaves {plan.virtual_stages} stages per device; GPipe runs its "
                f"{plan.num_stages} stages as partitions in fill-drain order, not interleaved "
                "(DistributedPipeline runs interleaved schedules)",
                stacklevel=2,
            )
        devices = [d.name for d in plan.devices]
        mismatch = colocation_mismatch(plan, devices)
        if mismatch is not None:
            warnings.warn(mismatch, stacklevel=2)
        checkpoint, recompute = plan_recomputation(plan)
        return cls(
            module,
            plan.balance,
            devices=devices,
            chunks=plan.chunks,
            checkpoint=checkpoint,
            recompute=recompute,
            **kwargs,
        )

    @property
    def shared_devices(self) -> list[list[int]]:
        """The partitions that share one physical device and take turns on it, as groups of
        partition indices (empty when each has its own), as a plan records them."""
        return device_groups(self.devices)

    @property
    def replicated(self) -> dict[str, tuple[int, ...]]:
        """The tensors several partitions hold, by name: the partitions, the owner first."""
        replicas: Replicas = self.__dict__["_replicas"]
        return replicas.stages

    @property
    def partitions(self) -> nn.ModuleList:
        """The partitions: one ``nn.Sequential`` per device, sharing this module's layers."""
        partitions: nn.ModuleList = self.__dict__["_partitions"]
        return partitions

    def __len__(self) -> int:
        return sum(self.balance)

    def __iter__(self) -> Iterator[nn.Module]:
        for partition in self.partitions:
            yield from partition.children()

    def __getitem__(self, index: int) -> nn.Module:
        return list(self)[index]

    def forward(self, input: TensorOrTensors, *more: Any) -> TensorOrTensors:
        """Runs a mini-batch through the pipeline.

        Called as the ``nn.Sequential`` is, with one input (a model's sample ``(x,)`` is
        the call ``pipe(x)``); a tuple is that one input, which the first layer takes as
        one value, as do the layers after a layer that returns one.

        Args:
            input: a tensor or tuple of tensors with the batch along dim 0; moved to the
                first device if it is elsewhere.

        Returns:
            The module's output for the whole mini-batch, on the last device.

        Raises:
            TypeError: more than one input, or not tensors.
        """
        if more:
            raise TypeError(
                f"GPipe takes one input, as nn.Sequential does, not {1 + len(more)}: pass "
                "a tuple of tensors as one value for a first layer that takes a tuple, or "
                "split a model whose forward takes several inputs with autopipe.wrap"
            )
        check(input)
        first = self.devices[0]
        if isinstance(input, torch.Tensor):
            input = input.to(first)
        else:
            input = tuple(t.to(first) for t in input)
        batches = scatter(input, self.chunks)
        replicas: Replicas = self.__dict__["_replicas"]
        replicas.refresh()  # from the parameters as they are now, in the caller's grad mode
        training = self.training and torch.is_grad_enabled()
        m = len(batches)
        modes = [self.checkpoint] if isinstance(self.checkpoint, str) else self.checkpoint
        # A "units" partition checkpoints its listed layers itself (RecomputedUnits), not
        # whole micro-batches.
        whole = {"always": m, "except_last": m - 1, "never": 0, UNITS: 0}
        stops = [whole[mode] for mode in modes]
        stop = [s if training else 0 for s in stops]
        try:
            outputs = self._runtime().run(
                batches, stop[0] if len(stop) == 1 else stop, commit=self.training
            )
        except BaseException:
            # Statistics of a failed mini-batch must not leak into the next one.
            for module in self.modules():
                if isinstance(module, DeferredBatchNorm):
                    module._reset_pending()
            raise
        return gather(outputs)

    def _runtime(self) -> Pipeline:
        pipeline: Pipeline | None = self.__dict__["_pipeline"]
        if pipeline is None:
            pipeline = Pipeline(list(self.partitions), self.devices, self.chunks)
            object.__setattr__(self, "_pipeline", pipeline)
        return pipeline

    def close(self) -> None:
        """Stops the worker threads; a later call starts new ones."""
        pipeline: Pipeline | None = self.__dict__["_pipeline"]
        object.__setattr__(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.close()

    def __enter__(self) -> GPipe:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Threads and streams cannot be copied or pickled; a copy starts its own.
        state = self.__dict__.copy()
        state["_pipeline"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> GPipe:
        # The last forward's copies of tied tensors are graph nodes, which deepcopy refuses;
        # the copy makes its own at its first forward anyway.
        replicas: Replicas = self.__dict__["_replicas"]
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        with replicas.detached():
            clone.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return clone

    def train(self, mode: bool = True) -> GPipe:
        super().train(mode)
        for partition in self.partitions:
            partition.training = mode
        return self

    # The partitions live on their own devices: moving the whole model would break that.
    def cuda(self, device: Any = None) -> GPipe:
        raise _moving_denied()

    def cpu(self) -> GPipe:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> GPipe:
        refuse_device_move(args, kwargs)
        return super().to(*args, **kwargs)
