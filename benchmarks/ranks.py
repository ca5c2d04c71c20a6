"""Launches a benchmark's ranks on this machine and joins them: gloo, one thread each."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["init_rank", "spawn_ranks"]

ROOT = Path(__file__).resolve().parents[1]


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
    """Runs ``argv(rank)`` for every rank, waits, and returns rank 0's ``result.json``.

    Raises:
        SystemExit: a rank failed.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(argv(rank), env=env, cwd=ROOT) for rank in range(world)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("a benchmark rank failed")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    return result
