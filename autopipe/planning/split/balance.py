"""``partition``: the public balancer over per-layer costs and memory."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autopipe import PlanningError
from autopipe.planning.model.names import STRATEGIES
from autopipe.planning.model.quantities import parse_bytes
from autopipe.planning.model.spans import stage_spans
from autopipe.planning.split.minmax import minmax_partition

__all__ = ["partition"]


Capacity = float | str | Sequence[float | str] | None


def partition(
    costs: Sequence[float],
    stages: int,
    *,
    memory: Sequence[float] | Sequence[float | str] | None = None,
    capacity: Capacity = None,
    strategy: str = "optimal",
) -> list[int]:
    """Splits layers into contiguous stages, minimizing the largest stage cost.

    Args:
        costs: non-negative cost of each layer (e.g. seconds per micro-batch).
        stages: number of stages; each gets at least one layer.
        memory: non-negative memory of each layer (bytes, or sizes such as ``16GiB``);
            needed with ``capacity``.
        capacity: memory limit per stage in bytes (or a size such as ``16GiB``): one for
            all stages or one per stage.
        strategy: ``optimal`` (exact, memory-aware, the default), ``uniform`` (equal layer
            counts, DeepSpeed's ``partition_uniform``), ``parameters`` (DeepSpeed's
            ``partition_balanced`` over ``memory``, its default) or ``blockpartition``
            (torchgpipe's ``solve`` over ``costs``), each computed as its package does.
            Only ``optimal`` searches under the memory limit; the others are checked
            against it. (``torchtitan`` needs layer names: see :func:`autopipe.plan`.)

    Returns:
        A balance: layers per stage, each at least 1, summing to ``len(costs)``.

    Raises:
        ValueError: bad arguments, or no split fits (a :class:`PlanningError` naming the
            layer or stage and the missing bytes).
    """
    c = _weights(costs, "costs")
    n = len(c)
    if isinstance(stages, bool) or not isinstance(stages, (int, np.integer)) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r}")
    if stages > n:
        raise ValueError(f"cannot split {n} layers into {stages} non-empty stages")
    m = None if memory is None else _weights(memory, "memory")
    if m is not None and len(m) != n:
        raise ValueError(f"memory has {len(m)} entries but costs has {n}")
    caps = _capacities(capacity, stages)
    if caps is not None and m is None:
        raise ValueError("capacity needs memory: pass the memory of each layer")

    if strategy == "optimal":
        balance = minmax_partition(c, stages, m, caps)
        if balance is None:
            assert m is not None and caps is not None
            raise PlanningError(_partition_misfit(m, caps))
        return balance
    balance = baseline_balance(strategy, c.tolist(), stages, m)
    if m is not None and caps is not None:
        _check_fits(balance, m, caps)
    return balance


def baseline_balance(
    strategy: str,
    costs: np.ndarray | Sequence[float],
    stages: int,
    params: np.ndarray | None,
    names: Sequence[str] | None = None,
) -> list[int]:
    """The balance a comparison strategy picks (ignoring memory limits), as its peer does.

    Args:
        strategy: ``uniform``, ``parameters``, ``blockpartition`` or ``torchtitan``.
        costs: each layer's cost, the sequence ``blockpartition`` balances (torchgpipe's
            ``balance_by_time`` hands it integer microseconds).
        stages: number of stages.
        params: each layer's parameter count or bytes, for ``parameters``.
        names: the layers' names, for ``torchtitan``.

    Raises:
        ValueError: an unknown strategy, or one missing what it needs.
        PlanningError: the peer gives no split here (see the strategy's function).
    """
    from autopipe.planning.split import strategies, titan_split, torchgpipe_split

    if strategy == "uniform":
        return strategies.uniform(len(costs), stages)
    if strategy == "parameters":
        if params is None:
            raise ValueError("strategy 'parameters' needs the parameter bytes of each layer")
        return strategies.parameters(list(params), stages)
    if strategy == "blockpartition":
        return torchgpipe_split.blockpartition(list(costs), stages)
    if strategy == "torchtitan":
        if names is None:
            raise ValueError(
                "strategy 'torchtitan' places layers by their names (embedding, layers.N, "
                "norm + output): plan a profile with autopipe.plan"
            )
        return titan_split.torchtitan(names, stages)
    raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")


def _weights(values: Sequence[float] | Sequence[float | str], what: str) -> np.ndarray:
    array = _numeric(values)
    if array is not None:
        return _checked(array, what)
    if not isinstance(values, str) and isinstance(values, Sequence):
        # numpy would read "2" as 2.0: only memory takes strings, sizes such as 16GiB.
        sizes: tuple[type, ...] = (str,) if what == "memory" else ()
        bad = [v for v in values if isinstance(v, str | bytes) and not isinstance(v, sizes)]
        if bad:
            raise ValueError(f"{what} must be a sequence of numbers, got {bad[0]!r}")
        values = [parse_bytes(v, what) if isinstance(v, str) else v for v in values]
    try:
        array = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of numbers") from None
    return _checked(array, what)


def _numeric(values: object) -> np.ndarray | None:
    """``values`` as floats when numpy reads them as numbers, else ``None``.

    One conversion in C: a sequence holding a string (or anything else numpy cannot read
    as a number) comes out as strings or objects, and those take the element-wise path,
    which names the bad value; at 10⁶ layers it costs many times the split itself.
    """
    if isinstance(values, str | bytes):
        return None
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        return None
    if array.dtype.kind not in "biuf":
        return None
    return array.astype(float, copy=False)


def _checked(array: np.ndarray, what: str) -> np.ndarray:
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"{what} must be a non-empty flat sequence of numbers")
    if not np.all(np.isfinite(array)) or np.any(array < 0):
        raise ValueError(f"{what} must be finite and non-negative")
    return array


def _capacities(capacity: Capacity, stages: int) -> np.ndarray | None:
    if capacity is None:
        return None
    if isinstance(capacity, (str, int, float, np.number)):
        caps = np.full(stages, _capacity(capacity))
    elif isinstance(capacity, (Sequence, np.ndarray)):
        caps = np.array([_capacity(c) for c in capacity])
        if caps.shape != (stages,):
            raise ValueError(f"capacity has {caps.size} entries but there are {stages} stages")
    else:
        raise TypeError(f"capacity must be a size such as 16GiB or one per stage, got {capacity!r}")
    return caps


def _capacity(value: object) -> float:
    # Strings parse as plan() parses its memory; numbers stay exact (they may be fractions
    # of any unit) and may be inf, no limit.
    if isinstance(value, str):
        return float(parse_bytes(value, "capacity"))
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"capacity must be bytes or a size such as 16GiB, got {value!r}")
    if np.isnan(value) or value < 0:
        raise ValueError(f"capacity must be non-negative, got {value!r}")
    return float(value)


def _stage_overflow(balance: Sequence[int], memory: np.ndarray, caps: np.ndarray) -> np.ndarray:
    used = np.array([memory[a:b].sum() for a, b in stage_spans(balance)])
    return used - caps


def _check_fits(balance: Sequence[int], memory: np.ndarray, caps: np.ndarray) -> None:
    """Raises :class:`PlanningError` naming the first stage over its capacity."""
    over = _stage_overflow(balance, memory, caps)
    k = int(np.argmax(over))
    if over[k] > 0:
        start = int(np.sum(balance[:k]))
        raise PlanningError(
            f"stage {k} (layers {start}-{start + balance[k] - 1}) needs {over[k]:.0f} more "
            f"bytes than its capacity {caps[k]:.0f}; raise the memory limit or use more stages"
        )


def _partition_misfit(memory: np.ndarray, caps: np.ndarray) -> str:
    """Says which layer or stage cannot fit, and by how many bytes."""
    largest = float(caps.max())
    i = int(np.argmax(memory))
    if memory[i] > largest:
        return (
            f"layer {i} needs {memory[i]:.0f} bytes but the largest stage holds {largest:.0f} "
            f"({memory[i] - largest:.0f} bytes missing); no split can fit it"
        )
    # Grow every capacity by the same amount until a split fits: that amount is missing.
    lo, hi = 0.0, float(memory.sum())
    best = minmax_partition(np.zeros(len(memory)), len(caps), memory, caps + hi)
    assert best is not None
    for _ in range(100):
        if hi - lo <= max(1.0, 1e-9 * hi):
            break
        mid = 0.5 * (lo + hi)
        found = minmax_partition(np.zeros(len(memory)), len(caps), memory, caps + mid)
        if found is None:
            lo = mid
        else:
            best, hi = found, mid
    over = _stage_overflow(best, memory, caps)
    k = int(np.argmax(over))
    start = int(np.sum(best[:k]))
    return (
        f"no split into {len(caps)} stages fits: even the best split {best} needs "
        f"{over[k]:.0f} more bytes on stage {k} (layers {start}-{start + best[k] - 1}); "
        "raise the memory limit or use more stages"
    )
