"""The runner's collectives: this rank's device, failures named, and rank 0's result shared."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from profiler import default_device

__all__: list[str] = []  # internal to the distributed runner

T = TypeVar("T")


def rank_device(group: dist.ProcessGroup | None) -> torch.device:
    """This rank's default device: :func:`profiler.devices.default_device` for an ``nccl``
    group (which moves CUDA tensors only), else the CPU (where ``gloo`` keeps them)."""
    if "nccl" in str(dist.get_backend(group)):
        return default_device()
    return torch.device("cpu")


def collective(rank: int, what: str, function: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """Runs a collective; a failure names the likely cause (another rank) in the error."""
    try:
        return function(*args, **kw)
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {rank}: could not {what}: another rank failed, exited or is not "
            "constructing the same DistributedPipeline (see its log); waits end after the "
            "process group's timeout"
        ) from exc


def share_from_rank0(
    compute: Callable[[], T],
    group: dist.ProcessGroup | None,
    *,
    what: str,
    failed: str,
) -> T:
    """Runs ``compute()`` on the group's rank 0 and returns its result on every rank; a
    collective (every rank of ``group`` calls it; only rank 0 calls ``compute``).

    Args:
        compute: what rank 0 computes; its result must pickle.
        group: the ranks (default: the world).
        what: what the other ranks do, for the error when the broadcast fails
            (``"receive the plan from rank 0"``).
        failed: the error's prefix when ``compute`` raises (``"rank 0 could not plan the
            pipeline"``).

    Raises:
        ValueError: ``compute`` raised a ``ValueError`` on rank 0: the same on every rank,
            ``"{failed}: {type}: {message}"`` (on rank 0 chained to the original).
        RuntimeError: the same for any other exception of ``compute``, or the broadcast
            failed (another rank failed or exited; after the process group's timeout).
    """
    rank = dist.get_rank(group)
    box: list[Any] = [None]
    failure: Exception | None = None
    if rank == 0:
        try:
            box[0] = (None, compute())
        except Exception as exc:
            failure = exc
            kind = "value" if isinstance(exc, ValueError) else "runtime"
            box[0] = ((kind, f"{type(exc).__name__}: {exc}"), None)
    source = dist.get_global_rank(group or dist.group.WORLD, 0)  # type: ignore[arg-type]
    device = rank_device(group)
    on = device if device.type == "cuda" else None  # nccl pickles through a CUDA tensor
    broadcast = dist.broadcast_object_list
    collective(rank, what, broadcast, box, src=source, group=group, device=on)
    error, result = box[0]
    if error is not None:
        kind, message = error
        raise (ValueError if kind == "value" else RuntimeError)(f"{failed}: {message}") from failure
    return result
