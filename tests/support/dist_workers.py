"""Worker processes for the multi-rank tests: one rank each, results saved to files."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = 4
BATCH = 16
STUCK_TIMEOUT = 5.0  # seconds: the process group's timeout in the "stuck" scenario
# Micro-batches per replica with D=2: 4 rows each, as profiling BatchNorm needs 2 or more.
REPLICA_CHUNKS = 2
UNEVEN = 14  # rows of a batch that CHUNKS micro-batches split unevenly: 4, 4, 3, 3


def make_model(seed: int = 0, width: int = 16, batchnorm: bool = True) -> nn.Sequential:
    """A small model with a buffer-carrying layer, identical for equal seeds."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width) if batchnorm else nn.Identity(),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 3),
    )


def make_residual() -> nn.Module:
    """A non-Sequential model with skip connections, auto-wrapped into units."""
    from tests.support.wrap_models import ResidualMLP

    torch.manual_seed(0)
    return ResidualMLP()


def make_batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 3, generator=generator)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


@contextlib.contextmanager
def whole_batch_statistics(model: nn.Module) -> Iterator[None]:
    """Runs the block with the model's BatchNorm running statistics updated once, at the
    end, from every input each layer saw in it: the plain layer's own update on them all.

    The block runs the model micro-batch by micro-batch (each normalized with its own
    statistics, as in a pipeline), and its backward (which checks that the statistics
    it saved are unchanged); the layers' per-call updates are undone, then each layer
    runs once on the concatenation of its inputs, without gradients.
    """
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    seen: dict[int, list[Tensor]] = {id(m): [] for m in norms}
    saved = [{k: v.clone() for k, v in m._buffers.items() if v is not None} for m in norms]

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            seen[id(module)].append(args[0].detach())

    hooks = [m.register_forward_pre_hook(record) for m in norms]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for norm, state in zip(norms, saved):
            for key, value in state.items():
                norm.get_buffer(key).copy_(value)
            if seen[id(norm)]:
                norm(torch.cat(seen[id(norm)]))


def reference_step(model: nn.Module, x: Tensor, y: Tensor, chunks: int = CHUNKS) -> Tensor:
    """Single-process reference: the mean of per-micro-batch losses, back-propagated, and
    BatchNorm statistics updated once from the whole mini-batch."""
    pairs = zip(x.tensor_split(chunks), y.tensor_split(chunks))
    with whole_batch_statistics(model):
        loss = torch.stack([loss_fn(model(xb), yb) for xb, yb in pairs]).mean()
        loss.backward()
    return loss.detach()


@dataclass
class Run:
    """How one rank's process ended."""

    returncode: int | None
    output: str
    seconds: float


def launch(
    scenario: str, world: int, workdir: Path, limit: float = 60.0, wait_for: int | None = None
) -> list[Run]:
    """Starts ``world`` ranks of ``scenario``; waits for all (or rank ``wait_for``) to end,
    at most ``limit`` seconds, then kills what is left (their return code is ``None``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    logs = [open(workdir / f"log{r}.txt", "w+") for r in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.dist_workers",
                scenario,
                str(workdir),
                str(r),
                str(world),
            ],
            cwd=ROOT,
            env=env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    ended = [0.0] * world
    watched = procs if wait_for is None else [procs[wait_for]]
    while time.monotonic() - start < limit and any(p.poll() is None for p in watched):
        time.sleep(0.05)
        for r, p in enumerate(procs):
            if p.poll() is not None and not ended[r]:
                ended[r] = time.monotonic() - start
    runs = []
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
            p.wait()
            ended[r] = float("inf")
        logs[r].seek(0)
        runs.append(
            Run(p.returncode if ended[r] != float("inf") else None, logs[r].read(), ended[r])
        )
        logs[r].close()
    return runs


def scenario_results(scenario: str, world: int, workdir: Path, limit: float) -> list[Any]:
    """Runs a scenario on ``world`` spawned ranks; every rank must succeed; their results."""
    runs = launch(scenario, world, workdir, limit=limit)
    failed = [rank for rank, run in enumerate(runs) if run.returncode != 0]
    # The rank that failed first is the one whose error does not blame another rank.
    first = [r for r in failed if "another rank failed" not in runs[r].output] or failed
    assert not failed, f"ranks {failed} failed; rank {first[0]}:\n{runs[first[0]].output[-3000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@functools.cache
def reference_steps() -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Loss and gradients after one reference step, gradients and state after two."""
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reference_step(model, x, y)
    twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, once, twice, model.state_dict()


def assert_close(actual: Tensor, expected: Tensor, name: str = "") -> None:
    """Equal as one process computes it, up to the order of float additions."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def tiny_plan(data_parallel: int = 1, stages: int = 2) -> Any:
    """A plan of 8 equal layers in equal stages, made without a process group."""
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    profile = linear_profile([1.0] * 8)
    return evaluate(profile, [8 // stages] * stages, data_parallel=data_parallel)


def _grads(pipe: Any) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def _train(pipe: Any, x: Tensor, y: Tensor) -> dict[str, Any]:
    first = pipe.step(x, y)
    grads = _grads(pipe)
    pipe.step(x, y)  # no zero_grad: gradients must add up, not be rescaled
    twice = _grads(pipe)
    return {"loss": first, "grads": grads, "twice": twice, "balance": pipe.plan.balance}


def _wrapped(schedule: str) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    x = x[:, :5]
    pipe = DistributedPipeline(
        make_residual(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule
    )
    first = pipe.step(x, y)
    grads = _grads(pipe)
    state = pipe.gather_state_dict()
    return {"loss": first, "grads": grads, "balance": pipe.plan.balance, "state": state}


def _equal(rank: int, world: int) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    x, y = make_batch()
    results: dict[str, Any] = {}
    model = make_model()
    pipe = DistributedPipeline(model, x, loss_fn=loss_fn, chunks=CHUNKS, schedule="gpipe")
    results["gpipe"] = _train(pipe, x, y)
    results["state"] = pipe.gather_state_dict()
    # 1F1B on a given, deliberately uneven split (last stage gets one layer).
    profile = Profile.from_dict(pipe.plan.profile)
    balance = [1] * (world - 1) + [8 - (world - 1)]
    balance[0], balance[-1] = balance[-1], balance[0]
    given = evaluate(profile, balance, chunks=CHUNKS, schedule="1f1b")
    pipe = DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, plan=given)
    results["1f1b"] = _train(pipe, x, y)
    # Zero bubble, one stage per rank: the backward split into input and weight gradients.
    pipe = DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule="zb")
    results["zb"] = _train(pipe, x, y)
    # Mismatches, reported on every rank before the first step.
    errors = {}
    other = make_model(width=16 if rank == 0 else 12)
    try:
        DistributedPipeline(other, x, loss_fn=loss_fn, chunks=CHUNKS, profile=profile)
    except ValueError as exc:
        errors["model"] = str(exc)
    wrong = evaluate(profile, [4, 4] if world != 2 else [3, 3, 2], chunks=CHUNKS, schedule="1f1b")
    try:
        DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, plan=wrong)
    except ValueError as exc:
        errors["stages"] = str(exc)
    try:
        DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS if rank else 3)
    except ValueError as exc:
        errors["argument"] = str(exc)
    results["errors"] = errors
    for schedule in ("gpipe", "1f1b"):
        results[f"wrapped {schedule}"] = _wrapped(schedule)
    results["calibration"] = _calibration()
    results["uneven"] = _uneven()
    results["checkpointed"] = _checkpointed()
    results["searched"] = _searched()
    return results


def _searched() -> dict[str, Any]:
    """The configuration the search ranks first, built on every rank."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    pipe = DistributedPipeline.from_search(make_model(), x, loss_fn=loss_fn)
    result = _train(pipe, x, y)
    plan = pipe.plan
    result["config"] = (plan.num_devices, plan.data_parallel, plan.chunks, plan.virtual_stages)
    result["notes"] = plan.notes
    try:
        DistributedPipeline.from_search(
            make_model(), x, loss_fn=loss_fn, search_options={"memory": 100}
        )
    except ValueError as exc:
        result["error"] = str(exc)
    return result


def _checkpointed() -> dict[str, Any]:
    """Re-materialization in the stages (with BatchNorm): each mode and schedule."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.distributed.stage import StageModule

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    runs = [("always", "1f1b", 1), ("except_last", "gpipe", 1), ("auto", "1f1b", 1)]
    runs.append(("except_last", "gpipe", 2))  # looped BFS: backwards in reverse
    for mode, schedule, v in runs:
        pipe = DistributedPipeline(
            make_model(), x, schedule=schedule, checkpoint=mode, virtual_stages=v, **options
        )
        result = _train(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        stages = [m for m in pipe.module.modules() if isinstance(m, StageModule)]
        result["checkpointed"] = [(m.checkpoint, m.checkpointed) for m in stages]
        result["spared"] = [m.spared for m in stages]
        result["plan"] = pipe.plan.checkpoint
        results[f"{mode} {schedule}" + (f" x{v}" if v > 1 else "")] = result
    try:
        DistributedPipeline(make_model(), x, checkpoint="sometimes", **options)
    except ValueError as exc:
        results["error"] = str(exc)
    return results


def _uneven() -> dict[str, Any]:
    """Micro-batches of unequal size (padded for torch's stages), and BatchNorm refused."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    x, y = make_batch()
    x, y = x[:UNEVEN], y[:UNEVEN]
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    pipe = DistributedPipeline(make_model(batchnorm=False), x, schedule="1f1b", **options)
    results: dict[str, Any] = {"sequential": _train(pipe, x, y)}
    # The plan times every micro-batch at the padded size, as they run.
    profile = Profile.from_dict(pipe.plan.profile)
    same = {"chunks": CHUNKS, "schedule": "1f1b", "checkpoint": pipe.plan.checkpoint}
    results["plan"] = [
        [stage.compute for stage in plan.stages]
        for plan in (
            pipe.plan,
            evaluate(profile, pipe.plan.balance, padded=True, **same),
            evaluate(profile, pipe.plan.balance, batch=4 * CHUNKS, **same),  # 4 rows each
        )
    ]
    pipe = DistributedPipeline(make_residual(), x[:, :5], schedule="gpipe", **options)
    results["wrapped"] = {"loss": pipe.step(x[:, :5], y), "grads": _grads(pipe)}
    try:
        DistributedPipeline(make_model(), x, **options)
    except ValueError as exc:
        results["batchnorm"] = str(exc)
    return results


def _calibration() -> dict[str, Any]:
    from autopipe.distributed.calibration import calibrate_ranks
    from autopipe.planning.planner import plan
    from profiler.measure import profile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 8))
    x = torch.randn(8, 8)
    profile = profile_model(model, x, chunks=2, warmup=0, repeats=1, cold_cache=False)
    values = calibrate_ranks(profile, repeats=3, model=model, sample=x, virtual_stages=2)
    replicated = plan(profile, 1, data_parallel=2, checkpoint="never")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"values": values, "allreduce": replicated.allreduce, "params": params}


def _replica_train(pipe: Any, x: Tensor, y: Tensor, rows: slice) -> dict[str, Any]:
    """Two global steps, the state, a step on this replica's shard, one on unequal grads."""
    result = _train(pipe, x, y)
    result["state"] = pipe.gather_state_dict()
    result["own state"] = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    pipe.module.zero_grad()
    result["shard loss"] = pipe.step(x[rows], y[rows])
    result["shard"] = _grads(pipe)
    # Earlier gradients that differ between replicas stay; only the step's are averaged.
    for p in pipe.module.parameters():
        p.grad = torch.full_like(p, float(pipe.replica_index + 1))
    pipe.step(x, y)
    result["unequal"] = _grads(pipe)
    return result


def _replicas(rank: int, world: int) -> dict[str, Any]:
    """D=2 replicas of a K=world/2 stage pipeline."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from profiler.profile import Profile

    d, k = 2, world // 2
    x, y = make_batch()
    b = BATCH // d
    rows = slice(rank // k * b, (rank // k + 1) * b)
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": REPLICA_CHUNKS}
    pipe = DistributedPipeline(make_model(), x, schedule="gpipe", data_parallel=d, **options)
    plan = pipe.plan
    results["layout"] = (plan.data_parallel, plan.batch_size, pipe.batch_size, repr(pipe))
    results["gpipe"] = _replica_train(pipe, x, y, rows)
    # 1F1B on a given uneven split; the plan brings D, and its batch size marks the sample
    # (8 rows, a multiple of D·chunks, so global by size alone) as this replica's shard.
    profile = Profile.from_dict(plan.profile)
    balance = [8 - (k - 1)] + [1] * (k - 1)
    given = evaluate(
        profile, balance, chunks=REPLICA_CHUNKS, schedule="1f1b", data_parallel=d, batch=BATCH
    )
    pipe = DistributedPipeline(make_model(), x[rows], plan=given, **options)
    results["1f1b"] = _replica_train(pipe, x, y, rows)
    errors = {}
    try:
        pipe.step(x[:4], y[:4])
    except ValueError as exc:
        errors["step"] = str(exc)
    cases = {
        "world": {"data_parallel": 3},
        "plan": {"data_parallel": d, "plan": evaluate(profile, balance, chunks=REPLICA_CHUNKS)},
        "ranks": {"data_parallel": d if rank else 1},
    }
    for name, case in cases.items():
        try:
            DistributedPipeline(make_model(), x, **options, **case)
        except ValueError as exc:
            errors[name] = str(exc)
    results["errors"] = errors
    return results


def _virtual(rank: int) -> dict[str, Any]:
    """Two virtual stages per rank (K·v stages), both schedules, and the checks of v."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from autopipe.planning.simulation import makespan, simulate
    from profiler.profile import Profile

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "virtual_stages": 2}
    for schedule in ("gpipe", "1f1b", "zb"):
        pipe = DistributedPipeline(make_model(), x, chunks=CHUNKS, schedule=schedule, **options)
        result = _train(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        result["layout"] = (pipe.stage_indices, pipe.is_first, pipe.is_last, repr(pipe))
        result["optimized"] = sum(p.numel() for p in pipe.module.parameters())
        plan = pipe.plan
        result["plan"] = (plan.virtual_stages, plan.step_time, makespan(simulate(plan)))
        results[schedule] = result
    profile = Profile.from_dict(pipe.plan.profile)
    errors = {}
    cases = {
        "stages": {"plan": evaluate(profile, [4, 4], chunks=CHUNKS), "sample": x},
        "chunks": {"chunks": 5, "sample": x[:10]},  # 2 rounds of 2 or 3 micro-batches
        "ranks": {"virtual_stages": 2 if rank else 3, "sample": x},
        "planned": {"plan": evaluate(profile, [2] * 4, chunks=CHUNKS, virtual_stages=4)},
    }
    for name, case in cases.items():
        case = {"chunks": CHUNKS, "profile": profile, "sample": x, **options, **case}
        try:
            DistributedPipeline(make_model(), case.pop("sample"), **case)
        except ValueError as exc:
            errors[name] = str(exc)
    results["errors"] = errors
    return results


def _autocast() -> dict[str, Any]:
    """Profiled and trained under bfloat16 autocast; a step under an autocast the pipeline
    was not built for is refused (its stages would exchange float32-sized buffers)."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    results: dict[str, Any] = {}
    options: dict[str, Any] = {"loss_fn": loss_fn, "chunks": CHUNKS}
    for schedule in ("gpipe", "1f1b"):
        pipe = DistributedPipeline(
            make_model(), x, schedule=schedule, autocast="bfloat16", **options
        )
        loss = pipe.step(x, y)
        results[schedule] = {"loss": loss, "grads": _grads(pipe), "plan": pipe.plan.profile}
    plain = DistributedPipeline(make_model(), x, **options)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain.step(x, y)
    except ValueError as exc:
        results["refused"] = str(exc)
    return results


def _failing(rank: int, world: int, stay: bool) -> None:
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


def _fault(rank: int, kind: str) -> tuple[str, str, list[str]] | None:
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


class TwoInputs(nn.Module):
    """Two positional inputs, both taken by its first layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Bilinear(8, 3, 16)
        self.act = nn.Tanh()
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.out(self.act(self.hidden(self.act(self.first(a, b)))))


class Concat(nn.Module):
    """Takes a tuple as its one argument, as nn.Sequential passes it."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat(pair, dim=1)


def make_concat() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Concat(), nn.Linear(11, 16), nn.Tanh(), nn.Linear(16, 3))


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
        results[name] = {"losses": losses, "grads": _grads(pipe)}
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


def _validity(rank: int) -> dict[str, Any]:
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
        results[schedule] = {"errors": errors, "losses": losses, "grads": _grads(pipe)}
    results["samples"] = _samples({"loss_fn": loss_fn, "chunks": CHUNKS})  # the world group
    return results


class BatchNormCNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks with a residual, and a BatchNorm1d head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6, momentum=None),  # a cumulative average
        )
        self.head = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))

    def forward(self, x: Tensor) -> Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.block(y))
        return self.head(y.mean((2, 3)))


def make_bn_cnn() -> BatchNormCNN:
    torch.manual_seed(0)
    return BatchNormCNN()


def image_batches(steps: int = 3) -> list[tuple[Tensor, Tensor]]:
    """One mini-batch of BATCH 3×6×6 images and targets per step, each of another scale."""
    generator = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(BATCH, 3, 6, 6, generator=generator) * (1 + step) + step,
            torch.randn(BATCH, 3, generator=generator),
        )
        for step in range(steps)
    ]


def _batchnorm(world: int) -> dict[str, Any]:
    """Deferred BatchNorm statistics on each schedule, re-computed, turned off, and with
    D=2 replicas (on 4 ranks: momentum=None, re-computed, the global mini-batch)."""
    import warnings

    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    results: dict[str, Any] = {}
    if world == 4:
        model = make_model()
        model[3].momentum = None
        pipe = DistributedPipeline(
            model,
            x,
            loss_fn=loss_fn,
            chunks=REPLICA_CHUNKS,
            schedule="1f1b",
            checkpoint="always",
            data_parallel=2,
        )
        pipe.step(x, y)
        pipe.step(x * 2 + 1, y)
        own = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results["replicas"] = {"state": pipe.gather_state_dict(), "own": own}
        return results
    runs = {"gpipe": ("gpipe", "never"), "1f1b": ("1f1b", "never")}
    runs["1f1b always"] = ("1f1b", "always")
    for key, (schedule, mode) in runs.items():
        pipe = DistributedPipeline(
            make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule, checkpoint=mode
        )
        result = _train(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        results[key] = result
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = DistributedPipeline(
            model, x, loss_fn=loss_fn, chunks=CHUNKS, deferred_batch_norm=False
        )
    pipe.step(x, y)
    results["per micro-batch"] = {
        "state": pipe.gather_state_dict(),
        "warnings": [str(w.message) for w in caught],
        "classes": [type(m).__name__ for m in model.modules()],
    }
    return results


def _batchnorm_training() -> dict[str, Any]:
    """The BatchNorm CNN trained 3 SGD steps with momentum, in 4 micro-batches and in 1."""
    from autopipe.distributed import DistributedPipeline

    batches = image_batches()
    results: dict[str, Any] = {}
    for chunks, schedule in ((CHUNKS, "1f1b"), (1, "gpipe")):
        pipe = DistributedPipeline(
            make_bn_cnn(), batches[0][0], loss_fn=loss_fn, chunks=chunks, schedule=schedule
        )
        optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            pipe.step(x, y)
            optimizer.step()
            optimizer.zero_grad()
        results[f"chunks={chunks}"] = pipe.gather_state_dict()
    return results


# Tied parameters: one copy per rank holding a user, the copies' gradients summed.
TIED_STEPS = 3
TIED_VOCAB = 128
TIED_TOKENS = 8


class TiedBlock(nn.Module):
    """A block applying a Linear it may share with another block, then one of its own."""

    def __init__(self, shared: nn.Linear, out: int) -> None:
        super().__init__()
        self.shared = shared
        self.own = nn.Linear(shared.out_features, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.own(torch.tanh(self.shared(x)))


def make_tied_linear(middle: bool = False) -> nn.Sequential:
    """8 layers whose first and last apply one Linear (``0.shared`` is ``7.shared``), and
    with ``middle`` the fifth as well."""
    torch.manual_seed(0)
    shared = nn.Linear(8, 8)
    return nn.Sequential(
        TiedBlock(shared, 8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.Tanh(),
        TiedBlock(shared, 8) if middle else nn.Linear(8, 8),
        nn.GELU(),
        nn.Linear(8, 8),
        TiedBlock(shared, 3),
    )


def make_tied_gpt2() -> nn.Module:
    """Hugging Face GPT-2, default config but tiny (its LM head tied to the embedding), no
    dropout (the ranks draw other random numbers than one process)."""
    import transformers

    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=2,
        vocab_size=TIED_VOCAB,
        n_positions=TIED_TOKENS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def lm_loss(output: Any, target: Tensor) -> Tensor:
    return nn.functional.cross_entropy(output.logits.reshape(-1, TIED_VOCAB), target.reshape(-1))


def tied_case(kind: str) -> tuple[Any, Any, Tensor, Tensor]:
    """The model, its loss and one batch (inputs, targets) of a tied case."""
    generator = torch.Generator().manual_seed(3)
    if kind == "gpt2":
        ids = torch.randint(0, TIED_VOCAB, (BATCH, TIED_TOKENS + 1), generator=generator)
        return make_tied_gpt2(), lm_loss, ids[:, :-1], ids[:, 1:]
    x, y = make_batch()
    return make_tied_linear(middle=kind == "linear3"), loss_fn, x, y


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adam":
        # GPT-2's key biases get gradients of rounding noise only (softmax ignores them);
        # Adam's default eps would turn the noise into full steps of either sign.
        return torch.optim.Adam(params, lr=0.01, eps=1e-6)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def tied_runs(world: int) -> list[dict[str, Any]]:
    """The tied cases run on ``world`` ranks: model, schedule, D, v and whether the plan is
    made on rank 0 (else a given balance puts the first and last layers on two ranks)."""
    if world == 2:
        runs = [
            {"kind": kind, "schedule": schedule, "d": 1, "v": 1}
            for kind in ("linear", "gpt2")
            for schedule in ("1f1b", "gpipe")
        ]
        runs.append({"kind": "linear", "schedule": "zb", "d": 1, "v": 2})
        # Stages 0 and 2 on rank 0 use the Linear that stage 3 on rank 1 uses too.
        runs.append({"kind": "linear3", "schedule": "1f1b", "d": 1, "v": 2, "balance": [2] * 4})
        return runs
    return [
        {"kind": "gpt2", "schedule": "1f1b", "d": 1, "v": 1},
        {"kind": "linear", "schedule": "gpipe", "d": 1, "v": 1},
        {"kind": "gpt2", "schedule": "1f1b", "d": 2, "v": 1},
    ]


def _tied_run(run: dict[str, Any], optimizer: str) -> dict[str, Any]:
    """Two steps without ``zero_grad``, then TIED_STEPS optimizer steps: after each, the
    loss and every parameter of this rank (under the model's names)."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    model, loss, x, y = tied_case(run["kind"])
    chunks = REPLICA_CHUNKS if run["d"] > 1 else CHUNKS
    given = None
    if "balance" in run:
        profile = linear_profile([1.0] * len(model))
        options = {"chunks": chunks, "schedule": run["schedule"], "virtual_stages": run["v"]}
        given = evaluate(profile, run["balance"], **options)
    pipe = DistributedPipeline(
        model,
        x,
        loss_fn=loss,
        chunks=chunks,
        schedule=run["schedule"],
        data_parallel=run["d"],
        virtual_stages=run["v"],
        plan=given,
    )
    result: dict[str, Any] = {"balance": pipe.plan.balance, "stages": pipe.stage_indices}
    result["names"] = [name for name, _ in pipe.module.named_parameters()]
    pipe.step(x, y)
    pipe.step(x, y)  # no zero_grad: only each step's own gradients are summed
    result["twice"] = _grads(pipe)
    pipe.module.zero_grad()
    # A measured balance may leave a rank only layers without parameters (torch's
    # optimizers refuse an empty list): that rank has nothing to update.
    own = list(pipe.module.parameters())
    opt = make_optimizer(optimizer, own) if own else None
    steps = []
    for _ in range(TIED_STEPS):
        value = pipe.step(x, y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": value, "params": params})
    result["steps"] = steps
    result["state"] = pipe.gather_state_dict()
    return result


def _tied(world: int) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    results: dict[str, Any] = {}
    for index, run in enumerate(tied_runs(world)):
        for optimizer in ("adam", "sgd"):
            results[f"{index} {optimizer}"] = _tied_run(run, optimizer)
    # A buffer that layers on two ranks use and may write cannot be copied.
    norm = nn.BatchNorm1d(8)
    layers = [nn.Sequential(nn.Linear(8, 8), norm), nn.Tanh(), nn.Linear(8, 8)]
    model = nn.Sequential(*layers, nn.Sequential(norm, nn.Linear(8, 3)))
    x, _ = make_batch()
    try:
        DistributedPipeline(model, x, loss_fn=loss_fn, chunks=CHUNKS, deferred_batch_norm=False)
    except ValueError as exc:
        results["refused"] = str(exc)
    return results


# A parameter every layer reads (DeBERTa's relative embeddings, a shared bias): a copy on
# each rank, in float64 with plain SGD so that the pipeline matches one process to rounding.
SHARED_STEPS = 3
SHARED_CHUNKS = 2
SHARED_RUNS = [
    {"kind": "deberta", "schedule": "1f1b", "balance": [3, 2]},
    {"kind": "bias", "schedule": "1f1b", "balance": [2, 2]},
    {"kind": "bias", "schedule": "gpipe", "balance": [1, 3]},
]
SHARED_NAMES = {"deberta": "encoder.rel_embeddings.weight", "bias": "bias"}


def mse(output: Any, target: Tensor) -> Tensor:
    value = output if isinstance(output, Tensor) else output.last_hidden_state
    return (value - target).square().mean()


def shared_case(kind: str) -> tuple[nn.Module, Tensor, Tensor]:
    """The model (float64, whatever the default dtype), one batch of inputs and targets."""
    from tests.support.wrap_models import SharedBias

    generator = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    if kind == "deberta":
        from tests.support.hf_models import deberta_v2

        model = deberta_v2()[0].double()
        x = torch.randint(0, 50, (8, 8), generator=generator)
        return model, x, torch.randn(8, 8, 32, generator=generator, dtype=torch.float64)
    x = torch.randn(8, 8, generator=generator, dtype=torch.float64)
    return SharedBias().double(), x, torch.randn(8, 8, generator=generator, dtype=torch.float64)


def _shared_run(run: dict[str, Any]) -> dict[str, Any]:
    """One step's gradients, then SHARED_STEPS SGD steps: after each, the loss and this
    rank's parameters (under the model's names)."""
    from autopipe.distributed import DistributedPipeline
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    model, x, y = shared_case(run["kind"])
    profile = linear_profile([1.0] * sum(run["balance"]), batch=len(x), chunks=SHARED_CHUNKS)
    given = evaluate(profile, run["balance"], chunks=SHARED_CHUNKS, schedule=run["schedule"])
    pipe = DistributedPipeline(
        model, x, loss_fn=mse, chunks=SHARED_CHUNKS, schedule=run["schedule"], plan=given
    )
    result: dict[str, Any] = {"balance": pipe.plan.balance}
    result["first"] = pipe.step(x, y)
    result["grads"] = _grads(pipe)
    pipe.module.zero_grad()
    opt = torch.optim.SGD(pipe.module.parameters(), lr=0.1)
    steps = []
    for _ in range(SHARED_STEPS):
        value = pipe.step(x, y)
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in pipe.named_parameters()}
        steps.append({"loss": value, "params": params})
    result["steps"] = steps
    result["state"] = pipe.gather_state_dict()
    return result


def main(scenario: str, workdir: Path, rank: int, world: int) -> None:
    from autopipe.distributed import init_distributed

    init_distributed(
        "gloo",
        timeout=timedelta(minutes=1.0),
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)  # one thread per rank: the ranks share the host's CPUs
    if scenario == "equal":
        torch.save(_equal(rank, world), workdir / f"rank{rank}.pt")
    elif scenario == "virtual":
        torch.save(_virtual(rank), workdir / f"rank{rank}.pt")
    elif scenario == "autocast":
        torch.save(_autocast(), workdir / f"rank{rank}.pt")
    elif scenario == "replicas":
        torch.save(_replicas(rank, world), workdir / f"rank{rank}.pt")
    elif scenario == "validity":
        torch.save(_validity(rank), workdir / f"rank{rank}.pt")
    elif scenario == "batchnorm":
        torch.save(_batchnorm(world), workdir / f"rank{rank}.pt")
    elif scenario == "batchnorm-training":
        torch.save(_batchnorm_training(), workdir / f"rank{rank}.pt")
    elif scenario == "tied":
        torch.save(_tied(world), workdir / f"rank{rank}.pt")
    elif scenario == "shared":
        torch.save([_shared_run(run) for run in SHARED_RUNS], workdir / f"rank{rank}.pt")
    elif scenario in ("raise", "stuck"):
        _failing(rank, world, stay=scenario == "stuck")
    elif scenario.replace("-", " ") in FAULTS:
        torch.save(_fault(rank, scenario.replace("-", " ")), workdir / f"rank{rank}.pt")
        return  # a peer is gone: no barrier; its group's teardown has no one to wait for
    # Every rank leaves together and closes the group: a gloo group torn down by interpreter
    # exit while a peer still talks to it can abort the process.
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
