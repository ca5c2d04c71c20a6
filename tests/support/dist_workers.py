"""Launches the multi-rank scenarios: one process per rank, results saved to files.

``python -m tests.support.dist_workers SCENARIO WORKDIR RANK WORLD`` runs one rank; the
scenarios' workers live in the modules named in :func:`main`."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.paths import ROOT


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


def main(scenario: str, workdir: Path, rank: int, world: int) -> None:
    """Runs rank ``rank`` of ``scenario``; its results go to ``workdir/rank{rank}.pt``."""
    from autopipe.distributed import init_distributed

    # Imported here, in the rank's process: the tests that only launch need none of them.
    from tests.support import (
        batchnorm_workers,
        fault_workers,
        moe_runner_models,
        pipeline_workers,
        replica_workers,
        tied_workers,
        tp_workers,
        unit_recompute_workers,
        v_workers,
        zero_workers,
    )

    init_distributed(
        "gloo",
        timeout=timedelta(minutes=1.0),
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)  # one thread per rank: the ranks share the host's CPUs
    scenarios: dict[str, Callable[[], Any]] = {
        "equal": lambda: pipeline_workers.equal(rank, world),
        "constants": pipeline_workers.constants,
        "construction-calibration": lambda: pipeline_workers.construction_calibration(rank, world),
        "autocast": pipeline_workers.autocast,
        "virtual": lambda: replica_workers.virtual(rank),
        "replicas": lambda: replica_workers.replicas(rank, world),
        "validity": lambda: fault_workers.validity(rank),
        "batchnorm": lambda: batchnorm_workers.batchnorm(world),
        "batchnorm-training": batchnorm_workers.batchnorm_training,
        "tied": lambda: tied_workers.tied(world),
        "shared": lambda: [tied_workers.shared_run(run) for run in tied_workers.SHARED_RUNS],
        "tensor-parallel": lambda: tp_workers.tensor_parallel(world),
        "v": lambda: v_workers.v_runs(world, str(workdir)),
        "zero": lambda: zero_workers.sharded(world),
        "unit-recompute": lambda: unit_recompute_workers.unit_recompute(world),
        "moe": moe_runner_models.distributed_moe,
    }
    fault = scenario.replace("-", " ")
    if scenario in scenarios:
        torch.save(scenarios[scenario](), workdir / f"rank{rank}.pt")
    elif scenario in ("raise", "stuck"):
        fault_workers.failing(rank, world, stay=scenario == "stuck")
    elif fault in fault_workers.FAULTS:
        torch.save(fault_workers.fault(rank, fault), workdir / f"rank{rank}.pt")
        return  # a peer is gone: no barrier; its group's teardown has no one to wait for
    else:
        raise ValueError(f"unknown scenario {scenario!r}: see main() in {__file__}")
    # Every rank leaves together and closes the group: a gloo group torn down by interpreter
    # exit while a peer still talks to it can abort the process.
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
