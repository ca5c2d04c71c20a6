"""torchgpipe v0.0.7's own tests, run against autopipe.

The test files here are torchgpipe's, unchanged (BSD-3-Clause, see LICENSE). While they are
imported and while they run, ``import torchgpipe`` and its submodules resolve to autopipe's
functions of the same meaning; anywhere else the installed torchgpipe (if any) is untouched.
Tests of torchgpipe's internals, and of behaviour autopipe deliberately differs in, are
marked xfail below with the reason (docs/torchgpipe.md).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import autopipe
import autopipe.balance
import autopipe.balance.blockpartition
from autopipe.gpipe import GPipe, verify_module

HERE = Path(__file__).resolve().parent


def _module(name: str, package: bool = False, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    if package:
        module.__path__ = []  # a package: its submodules are looked up in sys.modules
    module.__dict__.update(attributes)
    return module


ALIASES = {
    "torchgpipe": _module(
        "torchgpipe",
        package=True,
        GPipe=GPipe,
        is_checkpointing=autopipe.is_checkpointing,
        is_recomputing=autopipe.is_recomputing,
        __version__=autopipe.__version__,
    ),
    "torchgpipe.gpipe": _module("torchgpipe.gpipe", GPipe=GPipe, verify_module=verify_module),
    "torchgpipe.balance": _module(
        "torchgpipe.balance",
        package=True,
        balance_by_time=autopipe.balance.balance_by_time,
        balance_by_size=autopipe.balance.balance_by_size,
        blockpartition=autopipe.balance.blockpartition,
    ),
    "torchgpipe.balance.blockpartition": autopipe.balance.blockpartition,
    "torchgpipe.balance.profile": _module(
        "torchgpipe.balance.profile", layerwise_sandbox=autopipe.balance.layerwise_sandbox
    ),
}


@contextlib.contextmanager
def torchgpipe_is_autopipe() -> Iterator[None]:
    """``import torchgpipe`` gives autopipe inside the block; sys.modules is restored after."""
    saved = {name: sys.modules.get(name) for name in ALIASES}
    real = [name for name in sys.modules if name.startswith("torchgpipe.")]
    hidden = {name: sys.modules.pop(name) for name in real if name not in ALIASES}
    sys.modules.update(ALIASES)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        sys.modules.update(hidden)


def _here(node: pytest.Item | pytest.Collector) -> bool:
    return Path(str(node.path)).resolve().parent == HERE


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    # A test module binds ``from torchgpipe import GPipe`` when it is imported, here.
    if isinstance(collector, pytest.Module) and _here(collector):
        with torchgpipe_is_autopipe():
            return (yield)
    return (yield)


@pytest.fixture(autouse=True)
def _aliased() -> Iterator[None]:
    with torchgpipe_is_autopipe():
        yield


@pytest.fixture(autouse=True)
def manual_seed_zero() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def cuda_sleep() -> Any:
    """Sleeps the current CUDA stream for the given seconds (a GPU busy loop)."""
    torch.empty(1, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles_per_ms = 1_000_000 / start.elapsed_time(end)
    return lambda seconds: torch.cuda._sleep(int(seconds * cycles_per_ms * 1000))


# test name (without parameters) -> why autopipe does not pass it (README's table).
XFAIL = {
    "test_gpipe::test_public_attrs": "chunks must be an int and checkpoint a str (or one per "
    "partition): 42.0 and objects with __str__ are refused, not converted",
    "test_gpipe::test_too_few_devices": "too few devices is a ValueError, not an IndexError",
    "test_gpipe::test_batch_size_indivisible": "pytest >= 8 refuses pytest.warns(None); "
    "tests/gpipe/test_torchgpipe_calls.py checks that no warning is raised",
    "test_gpipe::test_batch_size_small": "pytest >= 8 refuses pytest.warns(None); "
    "tests/gpipe/test_torchgpipe_calls.py checks that no warning is raised",
    "test_gpipe::test_checkpoint_eval": "internal: autopipe recomputes inside "
    "CheckpointBackward, it has no RecomputeBackward node",
    "test_gpipe::test_partitions": "state_dict() keys are the plain model's ('0.weight'), "
    "not 'partitions.0.0.weight'",
    "test_gpipe::test_named_children": "layers keep the plain model's names ('a'), not "
    "'partitions.0.a'",
    "test_gpipe::test_empty_module": "GPipe needs at least one partition",
    "test_gpipe::test_recommend_auto_balance": "the ValueError names autopipe.balance, "
    "not torchgpipe.balance",
    "test_gpipe::test_verify_module_duplicate_parameters_in_distinct_children": "autopipe "
    "supports a parameter shared by distinct layers (tied weights)",
    "test_inplace::test_inplace_on_requires_grad": "autopipe runs an in-place layer on a "
    "partition's input as the plain model does, instead of raising",
}

# test name -> why it is not run: its outcome depends on the machine, not on autopipe.
NOT_RUN = {
    "test_balance::test_balance_by_time_loop_resets_input": "times a Conv2d and a Linear "
    "that take about the same time (within ~20% here): their order, and so the balance, "
    "flips on a busy machine; tests/balance checks the balance of what was measured",
}

# torchgpipe marks these xfail because it gets them wrong; autopipe passes them.
FIXED = {"test_inplace::test_inplace_incorrect_grad"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not _here(item):
            continue
        name = f"{Path(str(item.path)).stem}::{item.name.split('[')[0]}"
        if name in XFAIL:
            item.add_marker(pytest.mark.xfail(reason=XFAIL[name], strict=True))
        if name in NOT_RUN:
            item.add_marker(pytest.mark.skip(reason=NOT_RUN[name]))
        if name in FIXED:
            item.own_markers = [mark for mark in item.own_markers if mark.name != "xfail"]
