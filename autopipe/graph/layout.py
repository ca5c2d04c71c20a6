"""The units of a model traced in both modes, merged until every boundary can be cut."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from autopipe.graph.liveness import Liveness, UnitIO, analyze
from autopipe.graph.sharing import (
    SharedState,
    adjacent_boundaries,
    find_shared,
    find_written,
    unit_state,
    unit_writes,
)
from autopipe.graph.stage_modules import UnitModule, build_graph_module
from autopipe.graph.tracing import Traced, trace
from autopipe.graph.units import Unit, merge_units, regroup, split_units, unit_paths

__all__ = ["Layout", "layout_model", "stage_of_units"]


@contextlib.contextmanager
def model_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """Puts every module in train or eval mode for the block, then restores each one's mode."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def trace_modes(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    both_modes: bool = True,
    **options: Any,
) -> dict[str, Traced]:
    """Traces the model in its current mode and in the other one.

    Returns ``{"any": traced}`` when both modes give the same graph, else
    ``{"train": ..., "eval": ...}`` with the current mode first, or only the current mode
    when tracing the other fails (e.g. batch norm in training on a sample of one) or when
    ``both_modes`` is false (a plan of the training step needs no eval graph, and a trace
    of a deep model takes a while).
    """
    current = "train" if model.training else "eval"
    other = "eval" if current == "train" else "train"
    first = trace(model, args, kwargs, **options)
    if not both_modes:
        return {current: first}
    try:
        with model_mode(model, current == "eval"):
            second = trace(model, args, kwargs, **options)
    except Exception as exc:
        warnings.warn(
            f"wrap(): the model traces in {current} mode only ({other} mode failed: "
            f"{' '.join(str(exc).split())[:200]}); switching it to {other} mode will fail",
            stacklevel=3,
        )
        return {current: first}
    if first.code() == second.code():
        return {"any": first}
    return {current: first, other: second}


def _state(traced: Traced, io: UnitIO) -> list[Tensor]:
    calls = [n for n in io.nodes if n.op == "call_module"]
    return unit_state(traced.root, [*io.attrs, *calls])


def _writes(traced: Traced, io: UnitIO) -> list[Tensor]:
    calls = [n for n in io.nodes if n.op == "call_module"]
    return unit_writes(traced.root, [*io.attrs, *calls])


@dataclass
class Layout:
    """Units that every traced mode can be cut between.

    Attributes:
        traced: the traces, by mode key (``any``, or ``train`` and ``eval``).
        units: the units of each mode, aligned: unit ``k`` holds the same module calls.
        liveness: the boundary analysis of each mode.
        shared: parameters and written buffers that several units use. Each stage
            holding a user gets a copy of one that is only read (see
            :class:`autopipe.gpipe.GPipe`), adjacent users too; the users of a written
            one are never adjacent (they were merged).
        merged: why boundaries of the initial split were merged, one line each.
        written: the names of the parameters and buffers some unit may write in place.
    """

    traced: dict[str, Traced]
    units: dict[str, list[Unit]]
    liveness: dict[str, Liveness]
    shared: list[SharedState]
    merged: list[str]
    written: set[str]

    @property
    def names(self) -> list[str]:
        return [unit.name for unit in next(iter(self.units.values()))]

    @property
    def primary(self) -> str:
        """The mode the model was in: the one profiled."""
        return next(iter(self.traced))

    def modules(self) -> list[UnitModule]:
        """One :class:`UnitModule` per unit, sharing the model's parameters."""
        built = []
        for k, name in enumerate(self.names):
            graphs = {
                mode: build_graph_module(self.traced[mode], self.liveness[mode].units[k])
                for mode in self.traced
            }
            built.append(UnitModule(name, graphs))
        return built

    def boundary_bytes(self) -> list[int]:
        """Bytes crossing each boundary in the profiled mode, at the traced batch size."""
        return list(self.liveness[self.primary].bytes)


def _regroup(
    runs: dict[str, list[Unit]], layout: list[Unit], mode: str, traced: dict[str, Traced]
) -> list[Unit]:
    try:
        return regroup(runs[mode], layout)
    except ValueError as exc:
        raise ValueError(
            f"the model's {mode} graph calls its modules in another order than its "
            f"{next(iter(traced))} graph ({exc}); wrap it in the mode it will run in"
        ) from None


def layout_model(
    model: nn.Module, traced: dict[str, Traced], granularity: str = "blocks"
) -> Layout:
    """Splits the traced model into units and merges them across boundaries that cannot
    be cut: a non-tensor value crosses (in any mode), or both sides use a tensor that some
    unit writes in place (a shared batch norm's running statistics, a counter), which
    copies on two stages would not keep equal. A parameter that is only read (a tied head,
    a relative-position table every layer reads) does not merge its users: each stage
    holding one gets a copy and the copies' gradients are summed."""
    paths = unit_paths(model, granularity)
    runs = {mode: split_units(t.graph, paths, t.values) for mode, t in traced.items()}
    primary = next(iter(traced))
    layout: list[Unit] = runs[primary]
    merged: list[str] = []
    while True:
        units = {m: layout if m == primary else _regroup(runs, layout, m, traced) for m in traced}
        liveness = {m: analyze(traced[m].graph, units[m], traced[m].values) for m in traced}
        state = [
            [t for m in traced for t in _state(traced[m], liveness[m].units[k])]
            for k in range(len(layout))
        ]
        shared = find_shared(model, state)
        writes = [
            _writes(traced[m], liveness[m].units[k]) for m in traced for k in range(len(layout))
        ]
        written = find_written(model, writes)
        bad: dict[int, str] = {}
        for mode, live in liveness.items():
            for b, why in live.invalid.items():
                bad.setdefault(b, why if mode in ("any", primary) else f"{why} ({mode} mode)")
        kept = [s for s in shared if s.name in written]
        for b in adjacent_boundaries(kept):
            names = [s.name for s in kept if b in s.units and b + 1 in s.units]
            bad.setdefault(b, f"both sides use {names[0]}, which is written in place")
        if not bad:
            return Layout(traced, units, liveness, shared, merged, written)
        merged += [
            f"{layout[b].name} | {layout[b + 1].name}: {why}" for b, why in sorted(bad.items())
        ]
        layout = merge_units(layout, bad)


def stage_of_units(balance: Sequence[int]) -> list[int]:
    """The stage of each unit for a balance."""
    return [k for k, size in enumerate(balance) for _ in range(size)]
