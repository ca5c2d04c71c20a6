"""Ranks that train the stages pipeline() builds from an exported split, one process each."""

from __future__ import annotations

import json
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

from autopipe.planning.model.plans import Plan
from tests.support.export_models import Llama
from tests.support.paths import ROOT

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


def _torch_stages(rank: int, plan: Plan) -> tuple[list[Any], list[nn.Module], Any]:
    """This rank's stages as torch's pipeline() splits the model by the exported split_spec."""
    from torch.distributed.pipelining import ScheduleGPipe, ScheduleInterleaved1F1B, pipeline

    code: dict[str, Any] = {}
    exec(plan.export("torch"), code)  # the snippet as a user pastes it
    x = make_tokens()[0]
    pipe = pipeline(
        make_llama(), mb_args=(x.tensor_split(CHUNKS)[0],), split_spec=code["split_spec"]
    )
    ranks = plan.num_stages // plan.virtual_stages
    indices = [rank + j * ranks for j in range(plan.virtual_stages)]  # looped placement
    stages: list[Any] = [pipe.build_stage(i, torch.device("cpu")) for i in indices]
    if plan.virtual_stages > 1:
        schedule: Any = ScheduleInterleaved1F1B(stages, n_microbatches=CHUNKS, loss_fn=token_loss)
    else:
        schedule = ScheduleGPipe(stages[0], n_microbatches=CHUNKS, loss_fn=token_loss)
    return stages, [pipe.get_stage_module(i) for i in indices], schedule


def _torchtitan_stages(world: int, plan: Plan) -> tuple[list[Any], list[nn.Module], Any]:
    """This rank's stages as torchtitan's splitter builds them from the exported config."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import _pipeline_module_split

    config = json.loads(plan.export("torchtitan-json"))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    name = config["pipeline_parallel_schedule"]
    parts = config["module_fqns_per_model_part"]
    stages, modules = _pipeline_module_split(make_llama(), mesh, name, torch.device("cpu"), parts)
    kind = get_schedule_class(name)
    run = stages if issubclass(kind, PipelineScheduleMulti) else stages[0]
    return stages, modules, kind(run, n_microbatches=CHUNKS, loss_fn=token_loss)


def _train(scenario: str, rank: int, world: int, workdir: Path) -> dict[str, Any]:
    """Builds this rank's stages from the exported split and trains one step."""
    plan = Plan.load(workdir / "plan.json")
    built = _torch_stages(rank, plan) if scenario == "torch" else _torchtitan_stages(world, plan)
    stages, modules, schedule = built
    x, y = make_tokens()
    losses: list[Tensor] = []
    last = any(stage.is_last for stage in stages)
    args = (x,) if any(stage.is_first for stage in stages) else ()
    kwargs: dict[str, Any] = {"target": y, "losses": losses} if last else {}
    schedule.step(*args, **kwargs)
    names = {
        stage.stage_index: sorted(n for n, _ in module.named_parameters())
        for stage, module in zip(stages, modules)
    }
    grads = {
        n: p.grad.clone() for m in modules for n, p in m.named_parameters() if p.grad is not None
    }
    torch.optim.SGD([p for m in modules for p in m.parameters()], lr=LR).step()
    after = {n: p.detach().clone() for m in modules for n, p in m.named_parameters()}
    loss = torch.stack(losses).mean() if last else None
    return {"stages": names, "grads": grads, "params": after, "loss": loss}


def run_ranks(
    world: int, workdir: Path, scenario: str = "torch", limit: float = 120.0
) -> list[dict[str, Any]]:
    """Trains a step on ``world`` spawned gloo ranks, the stages built by ``scenario``'s
    runtime (``torch`` or ``torchtitan``); every rank must succeed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "tests.support.export_workers", scenario, str(workdir)]
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


def main(scenario: str, workdir: Path, rank: int, world: int) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
        timeout=timedelta(minutes=1.0),
    )
    torch.set_num_threads(1)
    try:
        torch.save(_train(scenario, rank, world, workdir), workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
