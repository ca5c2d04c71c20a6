"""Gives each CPU rank on a host its own cores, so that its messages are not kept waiting.

Several ranks on one host that float over all its cores let the kernel queue one rank's
communication thread (gloo's, which moves the bytes of a send or receive) behind another
rank's compute for a scheduler slice, a few milliseconds: a pipeline stage then waits for
an activation that was sent long ago. Bound to disjoint cores, a rank that waits leaves
its core to its own communication thread, and messages arrive in about 0.1 ms.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["cpu_share"]


def cpu_share(cpus: list[int], local_rank: int, local_size: int) -> list[int]:
    """The slice of ``cpus`` that rank ``local_rank`` of ``local_size`` on a host gets.

    The CPUs are cut into ``local_size`` contiguous slices whose sizes differ by at most
    one; with more ranks than CPUs, rank r shares CPU ``r % len(cpus)``.

    Raises:
        ValueError: no CPUs, or a rank outside ``[0, local_size)``.
    """
    if not cpus:
        raise ValueError("no CPUs to bind to")
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local rank {local_rank} is not in [0, {local_size})")
    ordered = sorted(cpus)
    if local_size >= len(ordered):
        return [ordered[local_rank % len(ordered)]]
    base, extra = divmod(len(ordered), local_size)
    start = local_rank * base + min(local_rank, extra)
    return ordered[start : start + base + (local_rank < extra)]


def local_rank_and_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """This process's rank among the ranks on its host, and how many there are.

    torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` when set; else ``rank`` and
    ``world_size`` (all ranks on this host), else ``RANK`` and ``WORLD_SIZE``.

    Raises:
        ValueError: neither is known.
    """
    env = os.environ
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    if rank is None and "RANK" in env:
        rank = int(env["RANK"])
    if world_size is None and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
    if rank is None or world_size is None:
        raise ValueError(
            "bind_cpus needs this rank's place on the host: run under torchrun (LOCAL_RANK, "
            "LOCAL_WORLD_SIZE) or pass rank and world_size"
        )
    return rank, world_size


def bind_cpus(local_rank: int, local_size: int, *, threads: bool = True) -> list[int]:
    """Binds this process (every thread it has, and those it starts) to its share of CPUs.

    Call it before the process group is created, so that the backend's threads start
    bound. The share is :func:`cpu_share` of the CPUs the process may use now.

    Args:
        local_rank: this rank's index among the ranks on the host.
        local_size: how many ranks the host runs.
        threads: also set ``torch.set_num_threads`` to the share's size.

    Returns:
        The CPUs this process is bound to.

    Raises:
        ValueError: a rank outside ``[0, local_size)``.
        OSError: the platform cannot bind (not Linux).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("binding ranks to CPUs needs Linux (os.sched_setaffinity)")
    share = cpu_share(sorted(os.sched_getaffinity(0)), local_rank, local_size)
    # Threads already started (torch's intra-op pool) keep their mask unless set too.
    try:
        tasks = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        tasks = [0]
    for tid in tasks:
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(tid, share)
    os.sched_setaffinity(0, share)
    if threads:
        torch.set_num_threads(len(share))
    return share


@contextlib.contextmanager
def bound_as(local_rank: int, local_size: int) -> Iterator[list[int]]:
    """Runs the block on the CPUs and with the torch threads that rank ``local_rank`` of
    ``local_size`` gets from :func:`bind_cpus`, then puts this process's back.

    What is measured in the block (a profile) then holds for the rank that will run it,
    not for a process that has every core to itself. Yields the CPUs of the share.

    Raises:
        OSError: the platform cannot bind (not Linux).
    """
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("binding to a rank's CPUs needs Linux (os.sched_setaffinity)")
    before, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    share = bind_cpus(local_rank, local_size)
    try:
        yield share
    finally:
        with contextlib.suppress(OSError):
            tasks = [int(tid) for tid in os.listdir("/proc/self/task")]
            for tid in tasks:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, before)
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)
