"""Starts processes as the ranks of a local process group and gathers what each reports.

Each process runs ``target(rank, world, store, *args, messages)``: it joins the group
through the file ``store`` and puts ``("result", rank, value)`` on ``messages`` (or
``("error", rank, line)``; ``("progress", done, total, label)`` for the caller). A rank
that fails ends the others after a grace period, so a hung group does not outlive it.
"""

from __future__ import annotations

import contextlib
import queue as queues
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp

__all__: list[str] = []

Progress = Callable[[int, int, str], None]

# How long the other ranks get to report after one has failed, before they are ended.
_GRACE_S = 30.0


def local_backend(ranks: int, cuda: bool | None) -> str:
    """nccl on GPUs (``cuda``; ``None``: when there are any), one per rank; else gloo."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    if cuda:
        if torch.cuda.device_count() < ranks:
            raise ValueError(
                f"{ranks} ranks need {ranks} GPUs, and this host has "
                f"{torch.cuda.device_count()}; use {torch.cuda.device_count()} ranks or fewer"
            )
        return "nccl"
    return "gloo"


def run_on_local_ranks(
    target: Callable[..., None], args: tuple[Any, ...], ranks: int, progress: Progress | None
) -> dict[int, dict[str, Any]]:
    """Runs ``target(rank, world, store, *args, messages)`` on ``ranks`` new processes and
    returns each rank's result; a rank's failure is a ``RuntimeError`` naming it."""
    context = mp.get_context("spawn")
    messages = context.Queue()
    with tempfile.TemporaryDirectory(prefix="autopipe-bench-") as workdir:
        store = str(Path(workdir) / "store")
        procs = [
            context.Process(target=target, args=(rank, ranks, store, *args, messages), daemon=True)
            for rank in range(ranks)
        ]
        for proc in procs:
            proc.start()
        results, error = _collect(procs, messages, progress)
    if error is not None:
        raise RuntimeError(error)
    return results


def _collect(
    procs: list[Any], messages: Any, progress: Progress | None
) -> tuple[dict[int, dict[str, Any]], str | None]:
    """The ranks' results, or the first error one reported, once every rank has ended."""
    results: dict[int, dict[str, Any]] = {}
    error: str | None = None
    failed_at: float | None = None

    def handle(message: tuple[Any, ...]) -> None:
        nonlocal error, failed_at
        kind = message[0]
        if kind == "progress" and progress is not None:
            progress(*message[1:])
        elif kind == "result":
            results[message[1]] = message[2]
        elif kind == "error" and error is None:
            error = f"rank {message[1]} failed: {message[2]}"
            failed_at = time.monotonic()

    while any(proc.is_alive() for proc in procs):
        with contextlib.suppress(queues.Empty):
            handle(messages.get(timeout=0.1))
        if failed_at is None and any(proc.exitcode not in (None, 0) for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > _GRACE_S:
            for proc in procs:  # ranks left waiting on the failed one
                if proc.is_alive():
                    proc.terminate()
    while True:
        try:
            handle(messages.get(timeout=0.5))
        except queues.Empty:
            break
    for proc in procs:
        proc.join()
    if error is None and len(results) < len(procs):
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))
        error = f"a rank ended without a result ({codes})"
    return results, error


def report_to_launcher(messages: Any, rank: int, exc: BaseException) -> NoReturn:
    """Puts a launched rank's error on the launcher's queue as one line, then ends the rank
    (the launcher prints the line; the traceback would only repeat it once per rank)."""
    message = " ".join(str(exc).split())
    messages.put(("error", rank, f"{type(exc).__name__}: {message}"))
    raise SystemExit(1) from None
