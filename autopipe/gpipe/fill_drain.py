"""The fill-drain (GPipe) schedule: micro-batch ``i`` runs on partition ``j`` at clock ``i + j``.

Each device's worker walks its own partitions' tasks in clock order and hands outputs to
the next partition directly: in a local slot when the same worker owns it, through a queue
otherwise. Task ``(i, j)`` therefore starts as soon as ``(i, j - 1)`` and ``(i - 1, j)`` are
done, which is the clock-cycle schedule without a global barrier per clock, and the caller
waits once per call instead of once per clock.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from autopipe.gpipe.checkpoint import checkpoint
from autopipe.gpipe.dependency import fork, join
from autopipe.gpipe.microbatch import Batch
from autopipe.gpipe.stream import (
    AbstractStream,
    current_stream,
    new_stream,
    record_stream,
    use_stream,
    wait_stream,
)
from autopipe.gpipe.transfer import Route, transfer
from autopipe.gpipe.worker import ThreadContext, WorkerPool
from autopipe.microbatching import DeferredBatchNorm

__all__: list[str] = []  # internal to the package


def clock_cycles(num_microbatches: int, num_partitions: int) -> Iterator[list[tuple[int, int]]]:
    """Yields the ``(micro-batch, partition)`` tasks of each clock, partitions ascending."""
    m, n = num_microbatches, num_partitions
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


_STOP = object()  # sent instead of a micro-batch when the producer gave up


class _Request:
    """The state of one forward call, shared by the caller and the workers."""

    def __init__(self, batches: list[Batch], checkpoint_stop: list[int], commit: bool) -> None:
        self.batches = batches
        self.checkpoint_stop = checkpoint_stop
        self.commit = commit
        self.context = ThreadContext()
        self.outputs: list[Batch | None] = [None] * len(batches)
        self.queues: dict[int, queue.SimpleQueue[Any]] = {}
        self.done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.errors: list[tuple[tuple[int, int], BaseException]] = []
        self.failed = False

    def fail(self, task: tuple[int, int], exc: BaseException) -> None:
        # list.append and a bool store are atomic under the GIL: no lock on the error path.
        self.errors.append(((task[0] + task[1], task[1]), exc))
        self.failed = True


class Pipeline:
    """Runs micro-batches through partitions on their devices with the GPipe schedule.

    Args:
        partitions: the stages, each already on its device.
        devices: the device of each partition.
        chunks: the largest number of micro-batches a call will pass.
        owners: which worker thread runs each partition; see :class:`WorkerPool`.
    """

    def __init__(
        self,
        partitions: Sequence[nn.Module],
        devices: Sequence[torch.device],
        chunks: int,
        owners: Sequence[int] | None = None,
    ) -> None:
        self.partitions = list(partitions)
        self.devices = list(devices)
        self.pool = WorkerPool(self.devices, owners)
        # Each partition computes on its own stream, and has one copy stream per micro-batch
        # so the copies of different micro-batches never queue behind each other.
        self.streams: list[AbstractStream] = [new_stream(d) for d in self.devices]
        copy_streams = [[new_stream(d) for _ in range(chunks)] for d in self.devices]
        self.routes: list[list[Route]] = [[] for _ in self.devices]
        for j in range(1, len(self.devices)):
            prev, next_ = self.streams[j - 1], self.streams[j]
            self.routes[j] = [
                Route(prev, copy_streams[j - 1][i], copy_streams[j][i], next_)
                for i in range(chunks)
            ]
        self.deferred = [
            [m for m in p.modules() if isinstance(m, DeferredBatchNorm)] for p in self.partitions
        ]
        self._submit_lock = threading.Lock()

    def close(self) -> None:
        """Stops the worker threads."""
        self.pool.close()

    def run(
        self, batches: list[Batch], checkpoint_stop: int | Sequence[int], commit: bool = False
    ) -> list[Batch]:
        """Runs all micro-batches through all partitions.

        Args:
            batches: the input micro-batches, on the first device.
            checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed;
                one number for every partition or one per partition.
            commit: whether to commit deferred batch-norm statistics after the last one.

        Returns:
            The outputs of the last partition, on the last device.

        Raises:
            BaseException: the first error (in schedule order) raised by any partition.
        """
        stops = (
            [checkpoint_stop] * len(self.partitions)
            if isinstance(checkpoint_stop, int)
            else list(checkpoint_stop)
        )
        request = _Request(batches, stops, commit)
        n, owners = len(self.partitions), self.pool.owners
        for j in range(1, n):
            if owners[j] != owners[j - 1]:
                request.queues[j] = queue.SimpleQueue()
        # Partitions compute on their own streams: they must see what the caller's streams
        # wrote before this call (the input, parameters just updated by an optimizer).
        for j, device in enumerate(self.devices):
            wait_stream(self.streams[j], current_stream(device))
        for batch in batches:
            for tensor in batch:
                record_stream(tensor, self.streams[0])
        active = sorted(set(owners))
        if len(active) == 1 and self.devices[0].type == "cpu":
            # Every partition on the one CPU worker: nothing can overlap, so the caller runs
            # the tasks itself and saves a thread hand-off (and a cache migration) per call.
            with self._submit_lock:
                self._stage(request, active[0])
        else:
            with self._submit_lock:
                # Submitting atomically gives every worker the same order of requests, so
                # two threads calling concurrently cannot each wait on the other's request.
                for w in active:
                    self.pool.submit(w, functools.partial(self._stage, request, w))
        try:
            for _ in active:
                request.done.get()
        except BaseException:
            request.failed = True
            raise
        if request.errors:
            _, exc = min(request.errors, key=lambda e: e[0])
            request.errors.clear()
            raise exc
        # The caller reads the outputs (and committed statistics) on its current streams.
        for j, device in enumerate(self.devices):
            wait_stream(current_stream(device), self.streams[j])
        last = current_stream(self.devices[-1])
        outputs = []
        for output in request.outputs:
            assert output is not None
            for tensor in output:
                record_stream(tensor, last)
            outputs.append(output)
        return outputs

    def _stage(self, request: _Request, worker: int) -> None:
        """The job of one worker: its partitions' tasks for one call, in clock order."""
        n, m, owners = len(self.partitions), len(request.batches), self.pool.owners
        mine = [j for j in range(n) if owners[j] == worker]
        local: dict[int, list[Batch | None]] = {
            j: [None] * m for j in mine if j > 0 and j not in request.queues
        }
        phonies: dict[int, Tensor | None] = {}
        finished = False
        task = (0, mine[0])
        try:
            with request.context.applied():
                for k in range(m + n - 1):
                    for j in mine:
                        i = k - j
                        if not 0 <= i < m:
                            continue
                        if request.failed:
                            return
                        task = (i, j)
                        if j == 0:
                            batch = request.batches[i]
                        elif j in request.queues:  # produced by another worker
                            item = request.queues[j].get()
                            if item is _STOP:
                                return
                            batch = item
                        else:
                            slot = local[j]
                            batch, slot[i] = slot[i], None  # type: ignore[assignment]
                        output = self._compute(request, i, j, batch, phonies)
                        if j == n - 1:
                            request.outputs[i] = output
                        elif owners[j + 1] == worker:
                            local[j + 1][i] = output
                        else:
                            request.queues[j + 1].put(output)
                if request.commit:
                    for j in mine:
                        with use_stream(self.streams[j]):
                            for bn in self.deferred[j]:
                                bn.commit()
                finished = True
        except BaseException as exc:
            request.fail(task, exc)
        finally:
            if not finished:
                # Consumers on other workers may be waiting for our outputs: release them.
                for j in mine:
                    if j + 1 < n and owners[j + 1] != worker:
                        request.queues[j + 1].put(_STOP)
            request.done.put(worker)

    def _compute(
        self, request: _Request, i: int, j: int, batch: Batch, phonies: dict[int, Tensor | None]
    ) -> Batch:
        """Task ``(i, j)``: receive, run (maybe checkpointed) and fork micro-batch ``i``."""
        stream = self.streams[j]
        grad = request.context.grad_enabled
        with use_stream(stream):
            if j > 0:
                batch = transfer(batch, self.routes[j][i])
                if grad and i > 0:
                    # Micro-batch i must finish backward here before micro-batch i - 1 starts.
                    batch = join(batch, phonies.pop(j, None))
            partition = self.partitions[j]
            if i < request.checkpoint_stop[j]:
                output = checkpoint(partition, batch, self.devices[j])
            else:
                output = batch.call(partition)
            if request.context.autocast.regions:
                # Each micro-batch casts the weights afresh, as its own step would: casts
                # cached over the job would be shared by all, their gradients summed in
                # half precision.
                torch.clear_autocast_cache()
            if grad and j > 0 and i + 1 < len(request.batches):
                output, phonies[j] = fork(output)
        return output
