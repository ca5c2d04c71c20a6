"""Worker processes for the multi-rank tests of models built on the meta device."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tests.support.dist_models import CHUNKS
from tests.support.paths import ROOT
from tests.support.tied_workers import lm_loss, make_tied_gpt2, tied_case

STEPS = 3
LR = 0.1
# Each run: (name, virtual stages, schedule, whether init loads the reference's checkpoint).
RUNS = [("loaded", 1, "1f1b", True), ("virtual", 2, "1f1b", True), ("default", 1, "gpipe", False)]


def meta_gpt2() -> nn.Module:
    """:func:`make_tied_gpt2` built on the meta device: no storage."""
    with torch.device("meta"):
        return make_tied_gpt2()


class Scaled(nn.Module):
    """A parameter of its own that no initializer knows."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.empty(8))
        self.b = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)) * self.scale)


def _run(virtual: int, schedule: str, loaded: bool) -> dict[str, Any]:
    from autopipe.distributed import DistributedPipeline

    reference, _, x, y = tied_case("gpt2")
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference  # the checkpoint stands for a file: no rank keeps the model
    parts: list[list[str]] = []

    def init(part: nn.Module) -> None:
        keys = sorted(part.state_dict())
        parts.append(keys)
        part.load_state_dict({k: state[k] for k in keys})

    pipe = DistributedPipeline(
        meta_gpt2(),
        x,
        loss_fn=lm_loss,
        chunks=CHUNKS,
        schedule=schedule,
        virtual_stages=virtual,
        init=init if loaded else None,
    )
    result: dict[str, Any] = {"parts": parts, "stages": pipe.stage_indices}
    result["names"] = [name for name, _ in pipe.named_parameters()]
    result["meta left"] = [n for n, t in pipe.module.state_dict().items() if t.is_meta]
    result["start"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    own = list(pipe.module.parameters())
    optimizer = torch.optim.SGD(own, lr=LR) if own else None
    losses = []
    for _ in range(STEPS):
        losses.append(pipe.step(x, y))
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad()
    result["losses"] = losses
    result["params"] = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    result["state"] = pipe.gather_state_dict()
    return result


def _refused() -> str:
    from autopipe.distributed import DistributedPipeline

    with torch.device("meta"):
        model = Scaled()
    x = torch.randn(8, 8)
    try:
        DistributedPipeline(model, x, loss_fn=lambda o, t: o.sum(), chunks=2, schedule="gpipe")
    except ValueError as exc:
        return str(exc)
    return "not refused"


def _short_of_memory() -> tuple[str, list[int]]:
    """A stage larger than a fake free-memory figure: refused before it is materialized."""
    import profiler.memory_guard
    from autopipe.distributed import DistributedPipeline

    def stack() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))

    x = torch.randn(8, 64)
    loss_fn = lambda o, t: o.sum()  # noqa: E731
    planned = DistributedPipeline(stack(), x, loss_fn=loss_fn, chunks=2, schedule="gpipe")
    free = profiler.memory_guard.free_bytes
    # Smaller than any stage's parameters (two layers: 2 x 16.25 KiB), larger than nothing.
    profiler.memory_guard.free_bytes = lambda device: 1 << 14
    try:
        DistributedPipeline(stack(), x, loss_fn=loss_fn, chunks=2, plan=planned.plan)
    except ValueError as exc:
        return str(exc), planned.plan.balance
    finally:
        profiler.memory_guard.free_bytes = free
    return "not refused", planned.plan.balance


def _meta(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {name: _run(v, s, loaded) for name, v, s, loaded in RUNS}
    results["refused"] = _refused()
    results["short"] = _short_of_memory()
    return results


def launch(world: int, workdir: Path, limit: float) -> list[Any]:
    """Runs the scenario on ``world`` spawned gloo ranks; every rank must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.support.meta_workers", str(workdir)]
    logs = [workdir / f"log{r}.txt" for r in range(world)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(
                subprocess.Popen(
                    [*command, str(rank), str(world)],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=limit))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    failed = [r for r, code in enumerate(codes) if code != 0]
    assert not failed, (
        f"ranks {failed} failed; rank {failed[0]}:\n{logs[failed[0]].read_text()[-3000:]}"
    )
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def main(workdir: Path, rank: int, world: int) -> None:
    from autopipe.distributed import init_distributed

    init_distributed(
        "gloo",
        timeout=timedelta(minutes=1.0),
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)
    torch.save(_meta(rank), workdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
