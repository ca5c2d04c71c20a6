"""A pipeline schedule's step replayed from its fixed order of operations, for many splits.

Every device runs its operations in an order that depends only on the schedule, K, v and M
(:func:`autopipe.planning.schedules.interleaving.rank_order`), never on the stage times. So one step
is a fixed graph: an operation starts when its device has finished the previous one and its
input is there (a forward needs the previous stage's output, sent; a backward the next
stage's input gradient, or on the last stage its own forward). :func:`replay_order` puts
the operations in an order in which every input comes first, once per shape;
:func:`makespans` then walks it with numpy, every split at once (a max-plus recurrence),
and :func:`autopipe.planning.schedules.simulation.simulate` walks it for one plan, keeping the
events.

Per micro-batch stage ``s`` takes ``forward[s]`` (then ``transfer[s]`` sending its output,
the device busy, as the cost model charges the send to the stage) and ``backward[s]``,
after a re-computation of the forward when the micro-batch is checkpointed on that stage.

**DualPipeV's overlapped pairs.** Where ``dualpipev`` pairs a forward with a whole backward
of another micro-batch (:func:`~autopipe.planning.schedules.v_schedules.v_pairs`), each
half's all-to-alls run behind the other half's compute: with ``c`` the pair's compute
and ``a`` its all-to-alls (both halves' ``comm_forward`` / ``comm_backward``, parts of
``forward`` and ``backward``), the pair takes ``max(c, a)`` instead of ``c + a``. Its
halves still run in turn (each input awaited as before); each sheds the same share
``h = min(1, c / a)`` of its own all-to-alls, so each keeps at least its compute and the
two add up to ``max(c, a)``. Assumed: the overlap is perfect, the communication taking no
compute from the pair (DeepSeek gives it some of the GPU's SMs; that is not modelled),
and a half that waits for its input still hides what it would have. Sends between
stages, re-computation and every unpaired operation keep their full charge.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from autopipe.planning.schedules.interleaving import V_PLACED, rank_order, spared
from autopipe.planning.schedules.v_schedules import v_pairs

__all__: list[str] = []

# Which micro-batches a stage re-computes, by checkpoint mode: none, all, or all but the one
# whose backward the stage runs first (:func:`autopipe.planning.schedules.interleaving.spared`: the
# last in GPipe's reversed order, the first in 1F1B's).
NONE, ALL, ALL_BUT_ONE = 0, 1, 2
RECOMPUTE_CODES = {"never": NONE, "always": ALL, "except_last": ALL_BUT_ONE}
# Floats of the messages in flight of one block of splits (32 MiB).
_BLOCK_FLOATS = 1 << 22


@dataclass(frozen=True)
class Operation:
    """One operation of a step.

    Attributes:
        rank: the device that runs it (stage ``s`` runs on ``s mod K``).
        kind: ``"F"`` forward, ``"B"`` backward, or the backward's two halves under zero
            bubble: ``"I"`` the input's gradient (sent on), ``"W"`` the weights'.
        stage: the stage.
        micro_batch: the micro-batch, from 0.
        partner: under ``dualpipev``, the stage of the other half of the overlapped pair
            the operation is in; -1: not in one.
    """

    rank: int
    kind: str
    stage: int
    micro_batch: int
    partner: int = -1

    @property
    def forward(self) -> bool:
        return self.kind == "F"


def recomputes(code: Any, micro_batch: int, spared: int) -> Any:
    """Whether a stage with re-computation ``code`` re-computes ``micro_batch``, ``spared``
    being the micro-batch whose backward it runs first (element-wise for an array of
    codes)."""
    return (code == ALL) | ((code == ALL_BUT_ONE) & (micro_batch != spared))


@functools.lru_cache(maxsize=64)
def replay_order(ranks: int, virtual: int, chunks: int, schedule: str) -> tuple[Operation, ...]:
    """Every operation of a step, each after the operations it waits for.

    Args:
        ranks: K, the devices.
        virtual: v, stages per device (K·v stages).
        chunks: M, micro-batches.
        schedule: ``gpipe`` or ``1f1b``.

    Raises:
        ValueError: as :func:`~autopipe.planning.schedules.interleaving.rank_order`.
        RuntimeError: the devices' orders wait on each other (a deadlock).
    """
    last = ranks * virtual - 1
    orders = [rank_order(r, ranks, virtual, chunks, schedule) for r in range(ranks)]
    partners = [_partners(r, ranks, chunks, schedule, orders[r]) for r in range(ranks)]
    # Done: ("F", s, i) forwards (sent), ("G", s, i) input gradients (B or I).
    done: set[tuple[str, int, int]] = set()
    position = [0] * ranks
    out: list[Operation] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for r in range(ranks):
            while position[r] < len(orders[r]):
                op, stage, i = orders[r][position[r]]
                needs: tuple[str, int, int] | None
                if op == "F":
                    needs = ("F", stage - 1, i) if stage > 0 else None
                elif op == "W":
                    needs = ("G", stage, i)
                else:
                    needs = ("F", stage, i) if stage == last else ("G", stage + 1, i)
                if needs is not None and needs not in done:
                    break  # waits on another device; come back on the next sweep
                done.add(("F" if op == "F" else ("G" if op in "BI" else "W"), stage, i))
                out.append(Operation(r, op, stage, i, partners[r].get(position[r], -1)))
                position[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} schedule deadlocks for K={ranks}, v={virtual}")
    return tuple(out)


def _partners(
    rank: int, ranks: int, chunks: int, schedule: str, order: list[tuple[str, int, int]]
) -> dict[int, int]:
    """By position in ``rank``'s order, the stage of the other half of its overlapped pair."""
    if schedule not in V_PLACED:
        return {}
    out = {}
    for p in v_pairs(rank, ranks, chunks, schedule):
        out[p], out[p + 1] = order[p + 1][1], order[p][1]
    return out


def _hidden_shares(
    order: tuple[Operation, ...],
    forward: NDArray[np.float64],
    backward: NDArray[np.float64],
    comm: tuple[NDArray[np.float64], NDArray[np.float64]],
) -> dict[tuple[int, int], NDArray[np.float64]]:
    """Per overlapped pair ``(forward's stage, backward's stage)``, the share ``h`` of its
    all-to-alls that its compute hides (per row): ``min(1, c / a)``, 0 without any."""
    out = {}
    comm_f, comm_b = comm
    for op in order:
        if op.partner < 0 or op.kind != "F" or (op.stage, op.partner) in out:
            continue
        f, b = op.stage, op.partner
        out[f, b] = hidden_share(forward[:, f], comm_f[:, f], backward[:, b], comm_b[:, b])
    return out


def hidden_share(forward: Any, comm_forward: Any, backward: Any, comm_backward: Any) -> Any:
    """The share of an overlapped pair's all-to-alls its compute hides: ``min(1, c / a)``
    for the pair's compute ``c`` (both halves' times less their all-to-alls) and its
    all-to-alls ``a``; 0 without any (element-wise)."""
    compute = np.asarray(forward) - comm_forward + backward - comm_backward
    talk = np.asarray(comm_forward + comm_backward, dtype=float)
    safe = np.where(talk > 0, talk, 1.0)
    return np.where(talk > 0, np.clip(compute / safe, 0.0, 1.0), 0.0)


def _per_stage(forward: Any, ranks: int) -> tuple[NDArray[np.float64], int]:
    """``forward`` as (splits, stages) floats and its stages, which must divide among
    ``ranks``."""
    rows = np.atleast_2d(np.asarray(forward, dtype=float))
    stages = rows.shape[1]
    if ranks < 1 or not stages or stages % ranks:
        raise ValueError(f"{stages} stages do not divide among {ranks} ranks")
    return rows, stages


def hidden_seconds(
    forward: NDArray[np.float64],
    backward: NDArray[np.float64],
    comm_forward: NDArray[np.float64],
    comm_backward: NDArray[np.float64],
    ranks: int,
    chunks: int,
    schedule: str,
) -> NDArray[np.float64]:
    """Seconds of all-to-alls each rank's overlapped pairs hide in one step: (splits,
    ranks), zeros but under ``dualpipev`` (arguments as :func:`makespans`'s).

    Raises:
        ValueError: as :func:`makespans`.
    """
    forward, stages = _per_stage(forward, ranks)
    out = np.zeros((len(forward), ranks))
    if schedule not in V_PLACED:
        return out
    order = replay_order(ranks, stages // ranks, chunks, schedule)
    backward, comm_f, comm_b = (
        np.atleast_2d(np.asarray(a, dtype=float)) for a in (backward, comm_forward, comm_backward)
    )
    shares = _hidden_shares(order, forward, backward, (comm_f, comm_b))
    for op in order:
        if op.partner < 0:
            continue
        pair = (op.stage, op.partner) if op.kind == "F" else (op.partner, op.stage)
        comm = comm_f if op.kind == "F" else comm_b
        out[:, op.rank] += shares[pair] * comm[:, op.stage]
    return out


# Operation codes of a :func:`replay_program` step.
_F, _W, _B, _I = 0, 1, 2, 3
# One step of a program: (code, stage, micro-batch, rank, read slot, write slot, partner).
Step = tuple[int, int, int, int, int, int, int]


@functools.lru_cache(maxsize=64)
def replay_program(
    ranks: int, virtual: int, chunks: int, schedule: str
) -> tuple[tuple[Step, ...], int]:
    """:func:`replay_order` with each message in a slot: ``((code, stage, micro-batch,
    rank, read, write, partner), ...)`` and the slots' count.

    Each message (a forward's output, a backward's input gradient) is read once, so its
    slot is free again after its reader: the walk holds the messages in flight, not every
    stage's and micro-batch's. ``read`` is the slot the operation waits on (-1: none, a
    first stage's forward), ``write`` the one it fills (-1: none, a weights' pass or the
    first stage's input gradient, which no one reads); ``partner`` as
    :attr:`Operation.partner`.
    """
    order = replay_order(ranks, virtual, chunks, schedule)
    last = ranks * virtual - 1
    held: dict[tuple[str, int, int], int] = {}
    spare: list[int] = []
    slots = 0
    out = []
    for op in order:
        s, i = op.stage, op.micro_batch
        code = {"F": _F, "W": _W, "B": _B, "I": _I}[op.kind]
        read = write = -1
        if code == _F:
            if s > 0:
                read = held.pop(("F", s - 1, i))
        elif code != _W:
            read = held.pop(("F", s, i) if s == last else ("G", s + 1, i))
        if read >= 0:
            spare.append(read)
        if code == _F or (code != _W and s > 0):
            if spare:
                write = spare.pop()
            else:
                write, slots = slots, slots + 1
            held["F" if code == _F else "G", s, i] = write
        out.append((code, s, i, op.rank, read, write, op.partner))
    return tuple(out), slots


def makespans(
    forward: NDArray[np.float64],
    backward: NDArray[np.float64],
    transfer: NDArray[np.float64],
    recompute: NDArray[np.int64],
    ranks: int,
    chunks: int,
    schedule: str,
    weight: NDArray[np.float64] | None = None,
    comm: tuple[NDArray[np.float64], NDArray[np.float64]] | None = None,
) -> NDArray[np.float64]:
    """Seconds of one step for every row (split) of per-stage times.

    Args:
        forward: (splits, K·v) seconds of one forward per micro-batch.
        backward: (splits, K·v) seconds of one backward.
        transfer: (splits, K·v) seconds to send one forward output (0 on the last stage).
        recompute: (splits, K·v) :data:`RECOMPUTE_CODES` values.
        ranks: K; stage ``s`` runs on device ``s mod K``.
        chunks: M.
        schedule: ``gpipe``, ``1f1b`` or ``zb``.
        weight: (splits, K·v) share of each backward that computes the weights'
            gradients, which ``zb`` defers (its ``W``); default none.
        comm: ``(comm_forward, comm_backward)``, (splits, K·v) seconds of all-to-alls in
            ``forward`` and ``backward``, which ``dualpipev``'s overlapped pairs hide in
            part (see the module docstring); default none, as other schedules.

    Raises:
        ValueError: the stages do not divide among the ranks, or as :func:`replay_order`.
    """
    forward, stages = _per_stage(forward, ranks)
    order = replay_order(ranks, stages // ranks, chunks, schedule)
    first = spared(ranks, stages // ranks, chunks, schedule)
    arrays = [np.atleast_2d(np.asarray(a, dtype=float)) for a in (backward, transfer)]
    share = np.zeros_like(forward) if weight is None else np.atleast_2d(np.asarray(weight))
    codes = np.atleast_2d(np.asarray(recompute))
    talk = None
    if comm is not None and schedule in V_PLACED:
        talk = tuple(np.atleast_2d(np.asarray(a, dtype=float)) for a in comm)
    out = np.empty(len(forward))
    # One split: Python floats walk it many times faster (finite: they compare as numpy's).
    finite = all(np.isfinite(a).all() for a in (forward, *arrays, share))
    if len(forward) == 1 and finite and (talk is None or not any(a.any() for a in talk)):
        out[0] = _replay_one(
            order,
            forward[0].tolist(),
            arrays[0][0].tolist(),
            arrays[1][0].tolist(),
            share[0].tolist(),
            codes[0].tolist(),
            ranks,
            first,
        )
        return out
    program, slots = replay_program(ranks, stages // ranks, chunks, schedule)
    block = max(1, _BLOCK_FLOATS // max(slots, 1))
    for lo in range(0, len(forward), block):
        hi = lo + block
        rows = _Rows(forward[lo:hi], arrays[0][lo:hi], arrays[1][lo:hi], share[lo:hi], codes[lo:hi])
        comm_rows = None if talk is None else (talk[0][lo:hi], talk[1][lo:hi])
        out[lo:hi] = _replay(program, slots, rows, ranks, first, comm_rows)
    return out


class _Rows(NamedTuple):
    """One block of splits' per-stage times (rows: splits), as :func:`makespans` takes them."""

    forward: NDArray[np.float64]
    backward: NDArray[np.float64]
    transfer: NDArray[np.float64]
    weight: NDArray[np.float64]
    codes: NDArray[np.int64]


def _replay(
    program: tuple[Step, ...],
    slots: int,
    times: _Rows,
    ranks: int,
    first: tuple[int, ...],
    comm: tuple[NDArray[np.float64], NDArray[np.float64]] | None,
) -> NDArray[np.float64]:
    forward, backward, transfer, weight, codes = times
    rows = len(forward)
    held = np.zeros((slots, rows))  # the messages in flight (:func:`replay_program`)
    free = np.zeros((ranks, rows))
    # Per stage: whether any row re-computes there, and the re-computation before a
    # backward: of every micro-batch but the spared one, and of the spared one (``ALL``).
    recomputing = np.any(codes != NONE, axis=0).tolist()
    again = np.where(codes != NONE, forward, 0.0).T.copy()
    spared_again = np.where(codes == ALL, forward, 0.0).T.copy()
    # Stage-major copies: the walk reads one stage's column of every row at a time.
    fwd, bwd, send, share = (a.T.copy() for a in (forward, backward, transfer, weight))
    # An overlapped pair's halves each shed the share of their all-to-alls it hides.
    # By (forward?, stage, partner's stage): a rank pairs F0 with B1 and F1 with B0.
    hides: dict[tuple[bool, int, int], NDArray[np.float64]] = {}
    if comm is not None:
        comm_f, comm_b = comm
        for code, s, _, _, _, _, partner in program:
            if code == _F and partner >= 0 and (True, s, partner) not in hides:
                f, b = s, partner
                h = hidden_share(forward[:, f], comm_f[:, f], backward[:, b], comm_b[:, b])
                hides[True, f, b] = h * comm_f[:, f]
                hides[False, b, f] = h * comm_b[:, b]
    for code, s, i, r, read, write, partner in program:
        hidden = hides.get((code == _F, s, partner)) if partner >= 0 else None
        if code == _F:
            ready = held[read] if read >= 0 else free[r]
            end = np.maximum(free[r], ready) + fwd[s] + send[s]
        elif code == _W:  # after its own input gradient, on this device
            end = free[r] + bwd[s] * share[s]
        else:
            part = bwd[s] if code == _B else bwd[s] * (1.0 - share[s])
            end = np.maximum(free[r], held[read]) + part
            if recomputing[s]:
                end += spared_again[s] if i == first[s] else again[s]
        if hidden is not None:
            end = end - hidden
        if write >= 0:
            held[write] = end
        free[r] = end
    return np.asarray(free.max(axis=0))


def _replay_one(
    order: tuple[Operation, ...],
    forward: list[float],
    backward: list[float],
    transfer: list[float],
    weight: list[float],
    codes: list[int],
    ranks: int,
    first: tuple[int, ...],
) -> float:
    """:func:`_replay` of one split without overlapped all-to-alls, the same operations on
    floats in the same order."""
    last = len(forward) - 1
    sent: dict[tuple[int, int], float] = {}
    grads: dict[tuple[int, int], float] = {}
    free = [0.0] * ranks
    for op in order:
        s, i, r = op.stage, op.micro_batch, op.rank
        if op.kind == "F":
            ready = sent[s - 1, i] if s > 0 else free[r]
            end = max(free[r], ready) + forward[s] + transfer[s]
            sent[s, i] = end
        elif op.kind == "W":
            end = free[r] + backward[s] * weight[s]
        else:
            ready = sent[s, i] if s == last else grads[s + 1, i]
            part = backward[s] if op.kind == "B" else backward[s] * (1.0 - weight[s])
            end = max(free[r], ready) + part
            if codes[s] == ALL or (codes[s] == ALL_BUT_ONE and i != first[s]):
                end += forward[s]
            grads[s, i] = end
        free[r] = end
    return max(free)
