"""Worker processes for the measured-trace tests: each rank steps with and without a trace."""

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

from tests.support.dist_models import CHUNKS, loss_fn, make_batch, make_model, param_grads
from tests.support.paths import ROOT

# (name, schedule, virtual stages): every kind of schedule the runner runs.
CASES = [("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1), ("zb", "zb", 1), ("interleaved", "1f1b", 2)]


def launch(workdir: Path, world: int = 2, limit: float = 240.0) -> list[str]:
    """Runs the ranks; returns their logs, failing the test when a rank fails."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    module = "tests.support.trace_workers"
    logs = [workdir / f"log{r}.txt" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:
            command = [sys.executable, "-m", module, str(workdir), str(r), str(world)]
            procs.append(
                subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
    start = time.monotonic()
    while time.monotonic() - start < limit and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    texts = [log.read_text() for log in logs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{texts[r][-3000:]}"
    return texts


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _case(workdir: Path, name: str, schedule: str, virtual: int, profile: Any) -> dict[str, Any]:
    """Three steps untraced, and the same on a copy with the second traced, and the first
    step of another copy traced: the same numbers."""
    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    options: dict[str, Any] = {
        "loss_fn": loss_fn,
        "chunks": CHUNKS,
        "schedule": schedule,
        "virtual_stages": virtual,
        "profile": profile,
    }
    plain = DistributedPipeline(make_model(), x, **options)
    traced = DistributedPipeline(make_model(), x, **options)
    path = workdir / f"{name}.json"
    fresh = DistributedPipeline(make_model(), x, **options)
    first = fresh.step(x, y, trace=path)  # a pipeline's first step (it sets up torch's stages)
    pairs: list[tuple[Any, Any]] = []
    same = []
    # Step by step the same numbers: a later step traced (it overwrites the file), then
    # untraced again, the wrappers gone.
    for trace in (None, path, None):
        pairs.append((plain.step(x, y), traced.step(x, y, trace=trace)))
        same.append(_same(param_grads(plain), param_grads(traced)))
        if len(pairs) == 1:
            pairs.append((pairs[0][0], first))
            same.append(_same(param_grads(plain), param_grads(fresh)))
    if plain.is_last:
        same += [torch.equal(a, b) for a, b in pairs]
    equal = all(same)
    grads = [param_grads(plain)]
    wrapped = [
        name
        for stage in traced.stages
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        if name in vars(stage)
    ]
    return {
        "equal": equal,
        "grads": len(grads[0]),
        "wrapped": wrapped,
        "plan": traced.plan.to_dict(),
        "stages": traced.stage_indices,
        "path": str(path),
    }


def main(workdir: Path, rank: int, world: int) -> None:
    from autopipe.distributed import DistributedPipeline, init_distributed

    init_distributed(
        "gloo",
        timeout=timedelta(minutes=1.0),
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)
    x, _ = make_batch()
    first = DistributedPipeline(make_model(), x, loss_fn=loss_fn, chunks=CHUNKS)
    from profiler.profile import Profile

    profile = Profile.from_dict(first.plan.profile)  # profiled once, on rank 0
    results: dict[str, Any] = {}
    for name, schedule, virtual in CASES:
        results[name] = _case(workdir, name, schedule, virtual, profile)
    # A bad trace path on rank 0 refuses the step on every rank, before it sends anything.
    try:
        first.step(*make_batch(), trace=workdir / "missing" / "t.json")
    except ValueError as exc:
        results["refused"] = str(exc)
    results["after refusal"] = first.step(*make_batch()) is not None or not first.is_last
    torch.save(results, workdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
