"""Two-rank half of benchmarks/accuracy/ranked_plans.py: the search's plans on two ranks.

Each rank calibrates the links with :func:`autopipe.distributed.calibrate_ranks`,
rank 0 runs ``search(profile, devices=2)`` (checkpoint ``never``: the runner keeps every
activation) and broadcasts the ranked plans, and every configuration is timed round-robin:
plans on two devices with :class:`autopipe.distributed.DistributedPipeline` (two stages,
or two replicas of one stage), plans on one device with the GPipe executor on rank 0.
Each rank is bound to its own CPU (``init_distributed(bind_cpus=True)``) unless
``--no-bind``.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from autopipe import GPipe, search  # noqa: E402
from autopipe.cli.model_file import load_sequential  # noqa: E402
from autopipe.distributed import DistributedPipeline  # noqa: E402
from autopipe.distributed.calibration import calibrate_ranks, slowest_seconds  # noqa: E402
from autopipe.planning.model.plans import Plan  # noqa: E402
from benchmarks.accuracy.measure import compare, distinct, stage_memory  # noqa: E402
from benchmarks.processes import init_rank, spawn_ranks  # noqa: E402
from profiler.profile import Profile  # noqa: E402

__all__ = ["run_two_ranks"]

WORLD = 2


def _loss(output: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return output.float().mean()


class _Runner:
    """One configuration on this rank: a step to time and its memory to measure."""

    def __init__(self, plan: Plan, model: Any, x: torch.Tensor, rank: int) -> None:
        self.plan, self.x, self.rank = plan, x, rank
        self.target = torch.zeros(x.shape[0], 1)
        self.pipe: Any = None
        self.modules: list[Any] = []
        if plan.num_devices == WORLD:
            self.pipe = DistributedPipeline(
                copy.deepcopy(model),
                x,
                loss_fn=_loss,
                chunks=plan.chunks,
                schedule=plan.schedule,
                plan=plan,
                data_parallel=plan.data_parallel,
            )
            self.modules = [self.pipe.module]
        elif rank == 0:
            self.pipe = GPipe(
                copy.deepcopy(model), plan.balance, devices=["cpu"], chunks=plan.chunks,
                checkpoint="never",
            )  # fmt: skip
            self.modules = [self.pipe]
        self.optimizer = (
            torch.optim.Adam([p for m in self.modules for p in m.parameters()])
            if self.modules
            else None
        )

    def step(self) -> None:
        if isinstance(self.pipe, DistributedPipeline):
            self.pipe.step(self.x, self.target)
        elif self.pipe is not None:
            _loss(self.pipe(self.x), self.target).backward()

    def timed(self) -> float:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        return slowest_seconds(self.step)  # the slower rank's time counts

    def memory(self) -> dict[str, int] | None:
        if self.optimizer is None:
            return None
        return stage_memory(self.modules, self.optimizer, self.step)


def worker(name: str, workdir: Path, rank: int, top: int, repeats: int, bind: bool) -> None:
    init_rank(workdir, rank, WORLD, bind=bind)
    model, x = load_sequential(ROOT / "examples" / f"{name}.py")
    profile = Profile.load(workdir / "profile.json")
    # With the model: compute scales measured with both ranks busy, as in training.
    link = calibrate_ranks(profile, repeats=repeats, model=model, sample=x)
    shared: list[Any] = [None]
    if rank == 0:
        # Even splits: the runner pads uneven micro-batches, computing all at the largest.
        options = {"checkpoints": ("never",), "even": True}
        found = search(profile, devices=WORLD, top=8 * top, **options)
        # One-device plans run on the GPipe executor, whose schedule is GPipe's.
        found = [p for p in found if p.num_devices == WORLD or p.schedule == "gpipe"]
        shared[0] = [p.to_dict() for p in distinct(found)[:top]]
    dist.broadcast_object_list(shared, src=0)
    plans = [Plan.from_dict(d) for d in shared[0]]
    runners = [_Runner(plan, model, x, rank) for plan in plans]
    times: list[list[float]] = [[] for _ in runners]
    order = list(range(len(runners)))
    shuffle = random.Random(0).shuffle  # the same order on both ranks
    for i in range(3 + repeats):
        shuffle(order)
        for j in order:
            took = runners[j].timed()
            if i >= 3:
                times[j].append(took)
    memories = [runner.memory() for runner in runners]
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, memories)
    if rank == 0:
        rows = []
        for j, plan in enumerate(plans):
            per_rank = [g[j] for g in gathered]
            # Stage k runs on rank k of replica 0 (two replicas: rank 0 holds stage 0).
            stages = [m for m in per_rank[: plan.num_stages] if m is not None]
            median = sorted(times[j])[len(times[j]) // 2]
            rows.append(compare(plan, median, stages))
        (workdir / "result.json").write_text(json.dumps({"link": link, "rows": rows}))
    dist.barrier()
    dist.destroy_process_group()


def run_two_ranks(
    name: str, profile: Profile, top: int, repeats: int, bind: bool = True
) -> dict[str, Any]:
    """Spawns the two ranks on this machine and returns their results."""
    with tempfile.TemporaryDirectory() as tmp:
        profile.save(Path(tmp) / "profile.json")
        command = [sys.executable, "-m", "benchmarks.accuracy.two_ranks", name, tmp]
        options = [str(top), str(repeats), "bind" if bind else "float"]
        return spawn_ranks(lambda r: [*command, str(r), *options], WORLD, Path(tmp))


if __name__ == "__main__":
    name_, dir_, rank_, top_, repeats_, bind_ = sys.argv[1:7]
    worker(name_, Path(dir_), int(rank_), int(top_), int(repeats_), bind_ == "bind")
