"""How benchmarks run their processes: ranks joined on this machine, malloc kept stable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["MALLOC", "init_rank", "rerun_with_stable_malloc", "run_autopipe", "spawn_ranks"]

ROOT = Path(__file__).resolve().parents[1]

# glibc's malloc hands large freed blocks back to the OS and page-faults them in again on
# the next step, by an amount that depends on the process's history; that alone moved a
# step of the same plan by up to 40% between runs. With these thresholds raised, freed
# memory stays in the process, as a caching allocator (CUDA's, jemalloc, tcmalloc) keeps
# it. Child processes inherit the setting.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def rerun_with_stable_malloc(module: str) -> None:
    """Replaces this process by ``python -m module <same arguments>`` with :data:`MALLOC`
    set, for repeatable CPU timings, unless it is set already (then returns)."""
    if all(os.environ.get(key) == value for key, value in MALLOC.items()):
        return
    os.chdir(ROOT)
    command = [sys.executable, "-m", module, *sys.argv[1:]]
    os.execve(sys.executable, command, {**os.environ, **MALLOC})


def run_autopipe(arguments: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m autopipe ARGUMENTS`` from the repository's root with :data:`MALLOC` set,
    its output captured; raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "autopipe", *arguments],
        cwd=ROOT,
        env={**os.environ, **MALLOC},
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def init_rank(
    workdir: Path, rank: int, world: int, minutes: float = 10.0, *, bind: bool = False
) -> None:
    """Joins the benchmark's gloo group through a file store in ``workdir``.

    With ``bind``, each rank gets its own share of the host's CPUs
    (:mod:`autopipe.distributed.cpu_binding`); one torch thread either way.
    """
    import torch

    from autopipe.distributed import init_distributed

    init_distributed(
        "gloo",
        bind_cpus=bind,
        timeout=timedelta(minutes=minutes),
        init_method=f"file://{workdir / 'store'}",
        rank=rank,
        world_size=world,
    )
    torch.set_num_threads(1)


def spawn_ranks(argv: Callable[[int], list[str]], world: int, workdir: Path) -> dict[str, Any]:
    """Runs ``argv(rank)`` for every rank from the repository's root, waits, and returns
    rank 0's ``result.json``.

    Raises:
        SystemExit: a rank failed.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv(rank), env=env, cwd=ROOT) for rank in range(world)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a benchmark rank failed")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    return result
