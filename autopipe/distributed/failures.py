"""Which rank failed a step: failures written to the process group's store, read by the others.

A rank that fails mid-step leaves the others blocked on a send or receive to it; they learn
of it only when its process exits (gloo: ``Connection closed by peer``) or when the group
times out, from an error that names neither the rank nor the cause. So a rank whose step
raises its own error writes it to the store the group was made with, before the error
leaves the step (and its process exits): when the others' wait fails, the record is
already there, and they raise an error naming that rank and its error instead.

A rank killed, or crashed without a Python error, writes nothing. Every rank writes its host
and process id when the pipeline is built; a rank whose wait fails looks for ranks on its own
host whose process is gone, names the first, and writes that record for it, so ranks on
other hosts that stopped in turn name it too. A rank that dies on another host, with no
rank of its host left to see it, stays unnamed: the error then is the backend's own.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Sequence

import torch.distributed as dist

from autopipe.distributed.replicas import rank_position

__all__: list[str] = []  # internal to the distributed runner

# How long a rank whose wait failed looks for the cause: a killed peer's process may take a
# moment to be gone from the process table after its connections closed.
GRACE_SECONDS = 3.0
_POLL_SECONDS = 0.05
_MESSAGE_CHARS = 500  # a record is one line of the error, not its traceback

# Pipelines built in this process per group: every rank builds them in the same order, so
# the count gives each pipeline the same key prefix on every rank.
_BUILT: Counter[str] = Counter()


def _default_store() -> dist.Store | None:
    """The store the default process group was made with, or ``None`` if torch has none."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # an older or newer torch, or a group made without a store
        return None


def process_alive(pid: int) -> bool:
    """Whether the process ``pid`` of this host still runs (a zombie counts as gone)."""
    if os.path.isdir("/proc/self"):  # Linux: the state tells a zombie from a running process
        try:
            with open(f"/proc/{pid}/stat") as stat:
                return stat.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:  # elsewhere the process table, in which a zombie still counts as alive
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def waited_in_vain(error: BaseException) -> bool:
    """Whether ``error`` is the backend's failure of a wait on another rank, not this rank's
    own: a closed connection or a timeout (gloo's errors name gloo's sources; the others
    raise ``DistError``)."""
    return isinstance(error, dist.DistError) or (
        type(error) is RuntimeError and "gloo" in str(error)
    )


def rank_names(stages: int, data_parallel: int, tensor_parallel: int = 1) -> list[str]:
    """How messages name the ranks of a pipeline group: ``"rank 3 (stage 1 of 2, replica 1)"``
    (rank r at :func:`autopipe.distributed.replicas.rank_position`: stage r // D of replica
    r % D; with t tensor-parallel ranks per stage, tensor rank r % t of stage r // (D·t) of
    replica (r // t) % D)."""
    t = tensor_parallel
    names = []
    for r in range(stages * data_parallel * t):
        stage, replica, tensor = rank_position(r, data_parallel, t)
        name = f"rank {r} (stage {stage} of {stages}"
        if t > 1:
            name += f", tensor rank {tensor} of {t}"
        names.append(name + (f", replica {replica})" if data_parallel > 1 else ")"))
    return names


class FailureBoard:
    """One pipeline's failure records in a store that every rank of its group reaches.

    Args:
        rank: this rank in the pipeline's group.
        names: how messages name each rank of the group: ``"rank 1 (stage 1 of 2)"``.
        store: the shared store (``None``: no records; the backend's errors stay as they are).
        prefix: the pipeline's keys in ``store``, the same on every rank.
    """

    def __init__(
        self, rank: int, names: Sequence[str], store: dist.Store | None, prefix: str
    ) -> None:
        self.rank, self.names, self.store, self.prefix = rank, list(names), store, prefix
        self.host = socket.gethostname()
        self._set(f"process/{self.rank}", f"{self.host} {os.getpid()}")

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, names: Sequence[str]) -> FailureBoard:
        """The board of a pipeline of ``group`` (default: the world), in the default group's
        store; a collective in effect: build it on every rank, in the same order as the
        pipelines themselves."""
        ranks = ",".join(str(r) for r in dist.get_process_group_ranks(group or dist.group.WORLD))
        prefix = f"autopipe/failures/{ranks}/{_BUILT[ranks]}/"
        _BUILT[ranks] += 1
        return cls(dist.get_rank(group), names, _default_store(), prefix)

    def _set(self, key: str, value: str) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self.prefix + key, value)
        except Exception:  # the store's host is gone too: the records are lost, not the step
            self.store = None

    def _get(self, key: str) -> str | None:
        """The record ``key`` if it exists; never waits for one."""
        if self.store is None:
            return None
        try:
            if not self.store.check([self.prefix + key]):
                return None
            return self.store.get(self.prefix + key).decode()
        except Exception:
            self.store = None
            return None

    def record(self, step: int, error: BaseException) -> None:
        """Writes this rank's own failure of ``step`` for the others to read."""
        line = f"{type(error).__name__}: {error}".split("\n", 1)[0][:_MESSAGE_CHARS]
        self._set(f"{step}/error/{self.rank}", line)

    def _others(self) -> range:
        return range(len(self.names))

    def _dead_neighbour(self) -> int | None:
        """The first other rank on this host whose process is gone, or ``None``."""
        for other in self._others():
            where = self._get(f"process/{other}") if other != self.rank else None
            if where is None:
                continue
            host, pid = where.rsplit(" ", 1)
            if host == self.host and not process_alive(int(pid)):
                return other
        return None

    def cause(self, step: int, wait: float = GRACE_SECONDS) -> str | None:
        """Which other rank failed ``step`` and how, as a message for this rank's error.

        Looks at the others' records, then at the processes of the ranks on this host,
        for at most ``wait`` seconds; ``None`` if neither names a rank.
        """
        deadline = time.monotonic() + wait
        while True:
            for kind in ("error", "exited"):
                for other in self._others():
                    found = self._get(f"{step}/{kind}/{other}") if other != self.rank else None
                    if found is not None:
                        return self._message(step, other, kind, found)
            dead = self._dead_neighbour()
            if dead is not None:
                self._set(f"{step}/exited/{dead}", "exited")  # for the ranks of other hosts
                return self._message(step, dead, "exited", "")
            if self.store is None or time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_SECONDS)

    def _message(self, step: int, other: int, kind: str, error: str) -> str:
        failed = self.names[other]
        if kind == "error":
            what = f"{failed} failed in step {step}: {error} (its log has the traceback)"
        else:
            what = (
                f"{failed} exited during step {step} without an error of its own (killed, "
                "or its process crashed)"
            )
        return f"{what}; {self.names[self.rank]} stopped waiting for it"

    def failed(self, step: int, error: BaseException) -> RuntimeError | None:
        """Handles ``error`` ending ``step`` on this rank: the error to raise instead, if any.

        The backend's failure of a wait (:func:`waited_in_vain`) becomes an error naming the
        rank that failed, when some record or process says which. This rank's own error is
        recorded for the others and gets a note naming this rank; the caller re-raises it.
        """
        if waited_in_vain(error):
            cause = self.cause(step)
            if cause is not None:
                return RuntimeError(cause)
        else:
            self.record(step, error)
        if hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(
                f"autopipe: step {step} failed on {self.names[self.rank]}; if another rank "
                "failed first, its log has the cause"
            )
        return None
