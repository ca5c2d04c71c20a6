"""The failure board: records of one rank read by the others, dead processes of this host."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch.distributed as dist

from autopipe.distributed.failures import FailureBoard, process_alive, rank_names, waited_in_vain


def _board(rank: int, store: dist.Store, names: list[str]) -> FailureBoard:
    """A rank's board over a store shared in this process, as the group's store is."""
    return FailureBoard(rank, names, store, "test/")


def test_rank_names_give_stage_and_replica() -> None:
    assert rank_names(2, 1) == ["rank 0 (stage 0 of 2)", "rank 1 (stage 1 of 2)"]
    # torchtitan's order: a stage's replicas on consecutive ranks, the tensor ranks inside.
    assert rank_names(2, 2) == [
        "rank 0 (stage 0 of 2, replica 0)",
        "rank 1 (stage 0 of 2, replica 1)",
        "rank 2 (stage 1 of 2, replica 0)",
        "rank 3 (stage 1 of 2, replica 1)",
    ]
    assert rank_names(1, 2, 2)[1] == "rank 1 (stage 0 of 1, tensor rank 1 of 2, replica 0)"
    assert rank_names(2, 1, 2)[2] == "rank 2 (stage 1 of 2, tensor rank 0 of 2)"


def test_only_the_backends_failed_waits_count_as_another_ranks() -> None:
    gloo = "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    assert waited_in_vain(RuntimeError(gloo))
    assert waited_in_vain(dist.DistError("timeout"))
    assert not waited_in_vain(RuntimeError("expected target dtype to be Long"))
    assert not waited_in_vain(ValueError(gloo))


def test_an_error_recorded_by_one_rank_is_named_by_the_other() -> None:
    store = dist.HashStore()
    names = rank_names(2, 1)
    failing, waiting = _board(1, store, names), _board(0, store, names)
    assert waiting.cause(step=3, wait=0) is None
    error = RuntimeError("deliberate\nsecond line")
    assert failing.failed(3, error) is None  # its own error: recorded and re-raised
    assert error.__notes__ == [
        "autopipe: step 3 failed on rank 1 (stage 1 of 2); if another rank failed first, "
        "its log has the cause"
    ]
    assert waiting.cause(step=2, wait=0) is None  # another step's record is not this one's
    lost = waiting.failed(3, RuntimeError("gloo: Connection closed by peer"))
    assert str(lost) == (
        "rank 1 (stage 1 of 2) failed in step 3: RuntimeError: deliberate (its log has the "
        "traceback); rank 0 (stage 0 of 2) stopped waiting for it"
    )


def test_a_dead_process_on_this_host_is_named_and_recorded_for_the_others() -> None:
    store = dist.HashStore()
    names = rank_names(3, 1)
    waiting, elsewhere = _board(0, store, names), _board(2, store, names)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not process_alive(gone.pid) and process_alive(os.getpid())
    store.set("test/process/1", f"{socket.gethostname()} {gone.pid}")
    expected = "rank 1 (stage 1 of 3) exited during step 0 without an error of its own"
    assert str(waiting.cause(0, wait=0)).startswith(expected)
    # A rank of another host sees no process of rank 1, but reads the record rank 0 left.
    elsewhere.host = "another host"
    assert str(elsewhere.cause(0, wait=0)).startswith(expected)
    assert str(elsewhere.cause(0, wait=0)).endswith("rank 2 (stage 2 of 3) stopped waiting for it")


def test_without_a_store_nothing_is_named() -> None:
    board = _board(0, dist.HashStore(), rank_names(2, 1))
    board.store = None
    assert board.failed(0, RuntimeError("gloo: Connection closed by peer")) is None
