"""Times whole training steps of several splits of one model on the single-process GPipe.

Each split gets its own copy of the layers in a :class:`autopipe.gpipe.GPipe`, and the
splits take turns, one step each, so that a slow spell of the machine touches all of them
alike. A step is what training does: forward, the loss (the mean of the output), backward
and an SGD step. After the timed steps one more step per split counts, per stage, the bytes
its layers save for backward (:class:`profiler.live_memory.SavedMemory`), untimed, so that
counting costs the timed steps nothing.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.gpipe.gpipe import GPipe
from autopipe.gpipe.recomputed_units import plan_recomputation
from autopipe.microbatching import (
    Progress,
    check_steps,
    kept_warmup_rounds,
    mean_output_loss,
    take_turns,
)
from autopipe.output import Measured
from autopipe.planning import Plan
from profiler import SavedMemory, synchronize

__all__ = ["time_splits"]


def pipeline_input(layers: nn.Sequential, sample: Tensor | tuple[Tensor, ...]) -> Any:
    """The one value GPipe takes for ``layers(*sample)``: a plain ``nn.Sequential`` takes
    the sample's one input, a traced model's units take the tuple of its inputs."""
    if isinstance(sample, Tensor):
        return sample
    if type(layers).forward is nn.Sequential.forward:
        return sample[0]
    return sample


def _synchronize(devices: Sequence[torch.device]) -> None:
    for device in devices:
        synchronize(device)


class _Split:
    """One split's pipeline, optimizer and step."""

    def __init__(self, layers: nn.Sequential, plan: Plan, devices: Sequence[str], lr: float):
        # The plan's checkpointing as planned: whole micro-batches, or single units.
        checkpoint, recompute = plan_recomputation(plan)
        self.pipe = GPipe(
            copy.deepcopy(layers),
            plan.balance,
            devices=list(devices),
            chunks=plan.chunks,
            checkpoint=checkpoint,
            recompute=recompute,
        )
        self.optimizer = torch.optim.SGD(self.pipe.parameters(), lr=lr)
        self.devices = [torch.device(d) for d in self.pipe.devices]
        self.update = 0.0

    def step(self, value: Any) -> float:
        _synchronize(self.devices)
        start = time.perf_counter()
        mean_output_loss(self.pipe(value)).backward()
        _synchronize(self.devices)
        stepped = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _synchronize(self.devices)
        end = time.perf_counter()
        self.update = end - stepped  # the optimizer's step, of the last step
        return end - start

    def saved_peaks(self, value: Any) -> list[int | None]:
        """One untimed step counting each stage's peak saved-for-backward bytes."""
        trackers = [SavedMemory.of_modules(part) for part in self.pipe.partitions]
        with _tracking(self.pipe.partitions, trackers):
            self.step(value)
        return [tracker.peak for tracker in trackers]


@contextmanager
def _tracking(partitions: nn.ModuleList, trackers: Sequence[SavedMemory]) -> Iterator[None]:
    """Counts what each partition saves into that partition's tracker.

    GPipe runs a partition on its own worker thread (and its re-computation in backward),
    and saved-tensor hooks are per thread: each partition, and each of its layers, enters
    its stage's tracker around its own forward, on whichever thread runs it; the outermost
    on a thread counts. So a partition's forward counts what its layers save and the
    inputs its re-computed units keep (saved outside those layers), and a unit re-run in
    backward counts on its own. A stage's layers run one at a time.
    """
    handles = []
    for part, tracker in zip(partitions, trackers, strict=True):
        depth = threading.local()
        for module in (part, *part.children()):
            handles.append(module.register_forward_pre_hook(_enter(tracker, depth)))
            handles.append(module.register_forward_hook(_exit(tracker, depth), always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _enter(tracker: SavedMemory, depth: threading.local) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        level = getattr(depth, "level", 0)
        depth.level = level + 1
        if level == 0:
            tracker.__enter__()

    return hook


def _exit(tracker: SavedMemory, depth: threading.local) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        depth.level -= 1
        if depth.level == 0:
            tracker.__exit__(None, None, None)

    return hook


def time_splits(
    layers: nn.Sequential,
    sample: Tensor | tuple[Tensor, ...],
    plans: Mapping[str, Plan],
    *,
    steps: int,
    warmup: int = 1,
    devices: Sequence[str] | None = None,
    lr: float = 1e-3,
    progress: Progress | None = None,
    in_place: bool = False,
) -> dict[str, Measured]:
    """Times training steps of every plan's split of ``layers``, the splits taking turns.

    Args:
        layers: the model's units; each split trains its own copy.
        sample: the mini-batch every step trains on, as ``layers(*sample)`` takes it.
        plans: the splits by label; each runs with its balance, micro-batches and
            checkpointing.
        steps: timed steps per split.
        warmup: untimed steps per split: the first ones first, the later ones among the
            timed steps (:func:`~autopipe.microbatching.step_timing.turn_order`).
        devices: one device per stage (default: each plan's own devices).
        lr: the SGD learning rate.
        progress: called with (steps done, steps in all, label) after every step.
        in_place: keep the median seconds of each split's later warm-up steps
            (:func:`~autopipe.microbatching.step_timing.kept_warmup_rounds`) as
            ``in_place`` of :class:`~autopipe.output.bench_summary.Measured`:
            ``{"stages": [], "step": s}``; the stages share the process, so only the whole
            step is timed; none with fewer than two warm-up steps.

    Returns:
        Per label, the timed steps' seconds and each stage's peak saved bytes.

    Raises:
        ValueError: fewer than one step, or a split GPipe refuses.
    """
    check_steps(steps, warmup)
    value = pipeline_input(layers, sample)
    splits = {
        label: _Split(layers, plan, devices or [d.name for d in plan.devices], lr)
        for label, plan in plans.items()
    }
    kept: dict[str, list[float]] = {label: [] for label in splits}
    updates: dict[str, list[float]] = {label: [] for label in splits}

    kept_rounds = kept_warmup_rounds(warmup)

    def warm_step(label: str, round_: int) -> float:
        seconds = splits[label].step(value)
        if round_ in kept_rounds:
            kept[label].append(seconds)
            updates[label].append(splits[label].update)
        return seconds

    times = take_turns(
        list(splits),
        lambda label: splits[label].step(value),
        steps=steps,
        warmup=warmup,
        progress=progress,
        warmup_step=warm_step if in_place else None,
    )
    warm = {
        label: {
            "stages": [],
            "step": statistics.median(found),
            "update": statistics.median(updates[label]),
        }
        for label, found in kept.items()
        if found
    }
    return {
        label: Measured(times[label], split.saved_peaks(value), warm.get(label))
        for label, split in splits.items()
    }
