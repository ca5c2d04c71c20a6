"""Binding CPU ranks to their own cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopipe.distributed.cpu_binding import cpu_share, local_rank_and_size
from tests.support.paths import ROOT


@pytest.mark.parametrize("ncpus", range(1, 9))
@pytest.mark.parametrize("size", range(1, 11))
def test_shares_cover_the_cpus_evenly(ncpus: int, size: int) -> None:
    cpus = [2 * c + 1 for c in range(ncpus)]  # any ids, not just 0..n-1
    shares = [cpu_share(cpus, r, size) for r in range(size)]
    if size >= ncpus:  # one CPU each, shared round-robin
        assert shares == [[cpus[r % ncpus]] for r in range(size)]
        return
    assert [c for share in shares for c in share] == cpus  # disjoint, contiguous, in order
    lengths = [len(share) for share in shares]
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1


def test_share_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="no CPUs"):
        cpu_share([], 0, 1)
    with pytest.raises(ValueError, match=r"local rank 2 is not in \[0, 2\)"):
        cpu_share([0, 1], 2, 2)


def test_local_rank_comes_from_torchrun_then_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="run under torchrun"):
        local_rank_and_size()
    assert local_rank_and_size(1, 4) == (1, 4)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert local_rank_and_size() == (3, 8)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_rank_and_size(3, 8) == (1, 2)


CHILD = """
import json, os, sys, threading, torch, torch.distributed as dist
from datetime import timedelta
from autopipe.distributed import init_distributed
before = sorted(os.sched_getaffinity(0))
torch.set_num_threads(len(before))
started = threading.Thread(target=threading.Event().wait, daemon=True)  # exists before binding
started.start()
init_distributed("gloo", bind_cpus=True, init_method="file://" + sys.argv[1], rank=0,
                 world_size=1, timeout=timedelta(seconds=30))
t = torch.ones(3)
dist.all_reduce(t)
masks = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
print(json.dumps({"before": before, "masks": masks, "threads": torch.get_num_threads(),
                  "sum": t.sum().item()}))
dist.destroy_process_group()
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux")
def test_init_distributed_binds_every_thread(tmp_path: Path) -> None:
    env = {**os.environ, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "store")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    share = cpu_share(result["before"], 0, 2)
    assert len(result["masks"]) >= 2  # the main thread, the earlier one, gloo's
    assert all(mask == share for mask in result["masks"].values())
    assert result["threads"] == len(share)
    assert result["sum"] == 3.0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux")
def test_bound_as_runs_the_block_as_the_rank_and_restores() -> None:
    import torch

    from autopipe.distributed.cpu_binding import bound_as

    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    with bound_as(0, 2) as share:
        assert share == cpu_share(before, 0, 2)
        assert sorted(os.sched_getaffinity(0)) == share
        assert torch.get_num_threads() == len(share)
    assert sorted(os.sched_getaffinity(0)) == before
    assert torch.get_num_threads() == threads
