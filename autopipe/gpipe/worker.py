"""Long-lived worker threads, one per device, that run pipeline stages.

Threads are started once and fed jobs through a queue, so a forward pass costs two queue
hops per device instead of a thread start (or two hops) per micro-batch. They hold no
reference to the model and stop when their pool is closed or garbage-collected.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

from autopipe.gpipe.autocast_state import AutocastState
from autopipe.gpipe.stream import use_device

__all__: list[str] = []  # internal to the package

Job = Callable[[], None]

_local = threading.local()


class ThreadContext:
    """Thread-local autograd and autocast settings, carried from the caller to the workers.

    ``torch.no_grad()``, ``torch.inference_mode()``, ``torch.autocast`` and
    ``torch.autograd.graph.saved_tensors_hooks`` only affect the thread that enters them;
    without this a worker would record graphs under ``no_grad``.
    The intra-op thread count is carried too: a fresh thread does not reliably pick up
    ``torch.set_num_threads`` and may run OpenMP with every core, which on a busy machine
    made CPU stages up to 100 times slower.
    """

    __slots__ = ("autocast", "grad_enabled", "inference", "num_threads", "saved_tensors_hooks")

    def __init__(self) -> None:
        self.num_threads = torch.get_num_threads()
        self.grad_enabled = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = AutocastState()
        # Only the innermost hooks apply to a saved tensor, and torch exposes just those.
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self.saved_tensors_hooks = top(False) if top is not None else None

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Runs the block under the captured settings."""
        if getattr(_local, "num_threads", None) != self.num_threads:
            torch.set_num_threads(self.num_threads)
            _local.num_threads = self.num_threads
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.enter_context(self.autocast.applied())
            if self.saved_tensors_hooks is not None:
                pack, unpack = self.saved_tensors_hooks
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            yield


def _serve(inbox: queue.SimpleQueue[Job | None], device: torch.device) -> None:
    # Jobs report their own errors; the guard only keeps a buggy job from killing the thread,
    # which would make every later call wait forever.
    with use_device(device):
        while True:
            job = inbox.get()
            if job is None:
                return
            with contextlib.suppress(BaseException):
                job()
            # Drop the job now: it refers to micro-batches, which would otherwise stay alive
            # (with their autograd graphs) until the next call.
            del job


class _Worker:
    __slots__ = ("device", "inbox", "thread")

    def __init__(self, device: torch.device, index: int) -> None:
        self.device = device
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_serve,
            args=(self.inbox, device),
            name=f"autopipe-worker-{index}-{device}",
            daemon=True,
        )
        self.thread.start()


def _shutdown(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.inbox.put(None)
    current = threading.current_thread()
    for worker in workers:
        # The pool may be collected by a garbage collection that runs on a worker itself.
        if worker.thread is not current:
            worker.thread.join()


class WorkerPool:
    """Worker threads for the partitions of a pipeline: by default one per distinct device.

    Partitions on one device share a worker, which runs their tasks in a fixed order. That
    keeps random numbers reproducible: the CPU generator, and each GPU's, is global, so
    partitions drawing from it concurrently would get a different order on every run and
    checkpoint recomputation could not replay their dropout masks.

    Args:
        devices: the device of each partition.
        owners: which worker runs each partition (numbered from 0), instead of one worker
            per device; used by tests to run CPU partitions on separate threads.
    """

    def __init__(
        self, devices: Sequence[torch.device], owners: Sequence[int] | None = None
    ) -> None:
        if owners is None:
            index: dict[torch.device, int] = {}
            for device in devices:
                index.setdefault(device, len(index))
            owners = [index[device] for device in devices]
        if len(owners) != len(devices) or sorted(set(owners)) != list(range(len(set(owners)))):
            raise ValueError(f"owners must number workers 0, 1, ... per partition, got {owners}")
        self.owners = list(owners)
        worker_devices = {w: devices[j] for j, w in reversed(list(enumerate(self.owners)))}
        self._workers = [_Worker(worker_devices[w], w) for w in range(len(worker_devices))]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)

    def __len__(self) -> int:
        return len(self._workers)

    @property
    def closed(self) -> bool:
        """Whether the workers have been told to stop."""
        return not self._finalizer.alive

    def submit(self, worker: int, job: Job) -> None:
        """Queues ``job`` on worker number ``worker``; jobs on one worker run in order."""
        if self.closed:
            raise RuntimeError("the worker pool is closed")
        self._workers[worker].inbox.put(job)

    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return [w.thread for w in self._workers]

    def close(self) -> None:
        """Stops the workers after the jobs already queued and waits for them to exit."""
        self._finalizer()
