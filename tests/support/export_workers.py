"""Ranks that train the stages pipeline() builds from an exported split, one process each."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from autopipe.planning.plans import Plan
from tests.support.export_models import Llama

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = 4
LR = 0.1


def make_llama() -> Llama:
    torch.manual_seed(0)
    return Llama()


def make_tokens() -> tuple[Tensor, Tensor]:
    """A batch of 8 sequences of 6 tokens and the next-token targets."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (8, 7), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def reference_step(model: nn.Module) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """The plain model's step: the mean of the micro-batches' losses, its gradients, and
    the parameters after one SGD step."""
    x, y = make_tokens()
    pairs = zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS))
    loss = torch.stack([token_loss(model(xb), yb) for xb, yb in pairs]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return loss.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """Builds this rank's stages from the exported split_spec and trains one step."""
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B, pipeline

    plan = Plan.load(workdir / "plan.json")
    code: dict[str, Any] = {}
    exec(plan.export("torch"), code)  # the snippet as a user pastes it
    model = make_llama()
    x, y = make_tokens()
    pipe = pipeline(model, mb_args=(x.tensor_split(CHUNKS)[0],), split_spec=code["split_spec"])
    ranks = plan.num_stages // plan.virtual_stages
    indices = [rank + j * ranks for j in range(plan.virtual_stages)]  # looped placement
    stages: list[Any] = [pipe.build_stage(i, torch.device("cpu")) for i in indices]
    if plan.virtual_stages > 1:
        schedule: Any = ScheduleInterleaved1F1B(stages, n_microbatches=CHUNKS, loss_fn=token_loss)
    else:
        schedule = ScheduleGPipe(stages[0], n_microbatches=CHUNKS, loss_fn=token_loss)
    losses: list[Tensor] = []
    last = any(stage.is_last for stage in stages)
    first = any(stage.is_first for stage in stages)
    args = (x,) if first else ()
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
    schedule.step(*args, **kwargs)
    modules = [pipe.get_stage_module(i) for i in indices]
    params = [p for module in modules for p in module.parameters()]
    names = {k: sorted(n for n, _ in pipe.get_stage_module(k).named_parameters()) for k in indices}
    grads = {
        n: p.grad.clone() for m in modules for n, p in m.named_parameters() if p.grad is not None
    }
    torch.optim.SGD(params, lr=LR).step()
    after = {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}
    loss = torch.stack(losses).mean() if last else None
    return {"stages": names, "grads": grads, "params": after, "loss": loss}


def run_ranks(world: int, workdir: Path, limit: float = 120.0) -> list[dict[str, Any]]:
    """Runs ``_train`` on ``world`` spawned gloo ranks; every rank must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "tests.support.export_workers", str(workdir)]
    logs = [open(workdir / f"log{r}.txt", "w+") for r in range(world)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [*argv, str(r), str(world)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        for r, log in enumerate(logs)
    ]
    start = time.monotonic()
    while time.monotonic() - start < limit and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    outputs = []
    for p, log in zip(procs, logs):
        if p.poll() is None:
            p.kill()
            p.wait()
        log.seek(0)
        outputs.append(log.read())
        log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks {failed} failed; rank {failed[0]}:\n{outputs[failed[0]][-3000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def main(workdir: Path, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=1.0),
    )
    torch.set_num_threads(1)
    try:
        torch.save(_train(rank, world, workdir), workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
