"""Rank workers of failures: a rank that raises, hangs or dies mid-step, steps refused on
one rank or on all, and samples of every shape."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.dist_models import (
    BATCH,
    CHUNKS,
    TwoInputs,
    loss_fn,
    make_batch,
    make_concat,
    make_model,
    param_grads,
)

STUCK_TIMEOUT = 5.0  # seconds: the process group's timeout in the "stuck" scenario


def failing(rank: int, world: int, stay: bool) -> None:
    """A loss that raises in the second step of a 1F1B pipeline; with ``stay`` the last rank
    then hangs instead of ending, so only the group's short timeout frees the others."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()

    calls = []

    def broken(output: Tensor, target: Tensor) -> Tensor:
        calls.append(1)
        if len(calls) > CHUNKS:  # fails in the second step
            raise RuntimeError("deliberate failure in the loss")
        return loss_fn(output, target)

    options: dict[str, Any] = {"loss_fn": broken, "chunks": CHUNKS, "schedule": "1f1b"}
    if stay:
        # A group with a short timeout, made once every rank is up (a slow start must not
        # time out), and a profile measured here: no rank waits long during setup.
        from profiler.measure import profile_model

        options["group"] = dist.new_group([0, 1], timeout=timedelta(seconds=STUCK_TIMEOUT))
        options["profile"] = profile_model(make_model(), x, chunks=CHUNKS, repeats=1)
    pipe = DistributedPipeline(make_model(), x, **options)
    pipe.step(x, y)
    try:
        pipe.step(x, y)
    except RuntimeError:
        if stay and pipe.is_last:
            time.sleep(120)  # alive but stuck: only the group's timeout frees the others
        raise


FAULTS = ("killed in a forward", "killed in a backward", "float target")


def fault(rank: int, kind: str) -> tuple[str, str, list[str]] | None:
    """One fault in the second step of a running pipeline of 2 ranks: rank 0 killed in a
    forward, rank 1 killed in a backward, or a float target for ``cross_entropy`` (which
    needs class indices) on rank 1. The error this rank's step raised: type, message, notes.
    A short group timeout makes a survivor that would wait for ever fail instead."""
    from autopipe.distributed import DistributedPipeline
    from profiler.measure import profile_model

    x, y = make_batch()
    classes = torch.arange(BATCH) % 3
    loss, target = (
        (nn.functional.cross_entropy, classes) if kind == "float target" else (loss_fn, y)
    )
    group = dist.new_group([0, 1], timeout=timedelta(seconds=STUCK_TIMEOUT))
    profile = profile_model(make_model(), x, chunks=CHUNKS, repeats=1)
    pipe = DistributedPipeline(
        make_model(), x, loss_fn=loss, chunks=CHUNKS, group=group, profile=profile
    )
    pipe.step(x, target)  # a good step first: the fault hits a pipeline that ran
    last = list(pipe.module.children())[-1]
    if kind == "killed in a forward" and rank == 0:
        last.register_forward_pre_hook(lambda *_: os._exit(3))
    if kind == "killed in a backward" and rank == 1:
        last.register_full_backward_hook(lambda *_: os._exit(3))
    if kind == "float target":
        target = classes.float()
    try:
        pipe.step(x, target)
    except Exception as exc:
        return type(exc).__name__, str(exc), list(getattr(exc, "__notes__", []))
    return None


def _samples(options: dict[str, Any]) -> dict[str, Any]:
    """Samples are the model's positional inputs, model(*sample), on every kind of model;
    each model is profiled on rank 0."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    b = make_batch(seed=3)[1]
    results: dict[str, Any] = {}
    runs = {
        "one tensor in a tuple": (make_model(), (x,), [(x,), x]),
        "two inputs": (TwoInputs(), (x, b), [(x, b)]),
        "one tuple": (make_concat(), ((x, b),), [((x, b),)]),
    }
    for name, (model, sample, steps) in runs.items():
        pipe = DistributedPipeline(model, sample, **options)
        losses = [pipe.step(inputs, y) for inputs in steps]
        results[name] = {"losses": losses, "grads": param_grads(pipe)}
    try:
        DistributedPipeline(make_model(), (x, b), **options)
    except ValueError as exc:
        results["several inputs"] = str(exc)
    return results


class Unmovable(Tensor):
    """A tensor that fails to move to a device, as a batch may (out of memory)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is Tensor.to:
            raise RuntimeError("deliberate failure moving the inputs")
        return super().__torch_function__(func, types, args, kwargs or {})


def validity(rank: int) -> dict[str, Any]:
    """Steps refused on one rank or on every rank: each is refused on every rank before it
    sends anything, and the next good step is exact. A short group timeout turns a rank
    left waiting on a refused step into a failure instead of a long hang."""
    from autopipe.distributed import DistributedPipeline
    from profiler.measure import profile_model

    x, y = make_batch()
    x2, y2 = make_batch(seed=2)
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    options["group"] = dist.new_group([0, 1], timeout=timedelta(seconds=STUCK_TIMEOUT))
    options["profile"] = profile_model(make_model(), x, chunks=CHUNKS, repeats=1)
    results: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = DistributedPipeline(make_model(), x, schedule=schedule, **options)
        last = pipe.is_last
        cases = {
            "bad batch on rank 0": (x[:5] if rank == 0 else x, y),
            "failure moving the inputs on rank 0": (x.as_subclass(Unmovable), y),
            "wrong feature size": (x[:, :5], y),
            "wrong dtype": (x.double(), y),
            "bad target on the last rank": (x, y[:5] if last else y),
            "target tuple on the last rank": (x, (y, y) if last else y),
            "inputs on the meta device on rank 0": (x.to("meta") if rank == 0 else x, y),
            "target on the meta device on the last rank": (x, y.to("meta") if last else y),
        }
        errors: dict[str, tuple[str, str] | None] = {}
        losses = []
        for name, (inputs, target) in cases.items():
            try:
                pipe.step(inputs, target)
                errors[name] = None
            except (ValueError, RuntimeError) as exc:
                errors[name] = (type(exc).__name__, str(exc))
            if name == "bad batch on rank 0":  # the next step, as a caller would retry
                losses.append(pipe.step(x2, y2))
        losses.append(pipe.step(x2, y2))
        results[schedule] = {"errors": errors, "losses": losses, "grads": param_grads(pipe)}
    results["samples"] = _samples({"loss_fn": loss_fn, "chunks": CHUNKS})  # the world group
    return results
