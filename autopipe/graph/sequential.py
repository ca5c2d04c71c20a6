"""A traced model as an ``nn.Sequential`` of its units, with the maps to and from its tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from autopipe.graph.flat_io import MEAN, FlatSpec
from autopipe.graph.layout import Layout, layout_model, trace_modes
from autopipe.graph.shapes import DynamicSpec, InputShapes
from autopipe.graph.sharing import SharedState
from autopipe.graph.stage_modules import UnitModule, UnitSequential

__all__ = ["ModelIO", "SequentialModel", "model_inputs", "prepare", "unit_sequential"]


def model_inputs(
    sample: tuple[Any, ...] | Tensor, kwargs: Mapping[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional inputs as a tuple and the keyword inputs in a fixed (sorted) order.

    The order is the one the traced graph takes the keyword inputs' tensors in, whatever
    order a caller passes them in.
    """
    args = sample if isinstance(sample, tuple) else (sample,)
    return args, dict(sorted((kwargs or {}).items()))


def prepare(
    model: nn.Module,
    sample: tuple[Any, ...] | Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    granularity: str = "blocks",
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    method: str = "auto",
    dynamic: DynamicSpec | None = None,
    both_modes: bool = True,
) -> Layout:
    """Traces the model (in both modes) and splits it into units that can be cut between.

    Takes the arguments of :func:`autopipe.wrap`; this is its first half, to inspect the
    units (``layout.names``, ``layout.liveness``, ``layout.merged``) without planning.
    With ``both_modes`` false only the model's current mode is traced (see
    :func:`autopipe.graph.layout.trace_modes`).
    """
    args, inputs = model_inputs(sample, kwargs)
    traced = trace_modes(
        model,
        args,
        inputs,
        both_modes=both_modes,
        leaf_modules=list(leaf_modules),
        method=method,
        dynamic=dynamic,
    )
    return layout_model(model, traced, granularity)


@dataclass(frozen=True)
class ModelIO:
    """How a traced model's inputs and outputs map to its units' flat tensors.

    Attributes:
        inputs: the structure of the model's ``(args, kwargs)``.
        outputs: the structure of its outputs, by mode key (``any``, or ``train`` and
            ``eval``).
        shapes: the input shapes and dtypes each mode's graph fixed (``None``: none fixed).
        method: how the model was traced: ``fx`` or ``export``.
    """

    inputs: FlatSpec
    outputs: Mapping[str, FlatSpec]
    shapes: Mapping[str, InputShapes | None]
    method: str

    @classmethod
    def of(cls, layout: Layout) -> ModelIO:
        """The inputs and outputs of the traced modes of ``layout``."""
        traced = layout.traced[layout.primary]
        return cls(
            inputs=traced.inputs,
            outputs={mode: t.outputs for mode, t in layout.traced.items()},
            shapes={mode: t.shapes for mode, t in layout.traced.items()},
            method=traced.method,
        )

    def key(self, training: bool) -> str:
        """The mode key of the graphs that run in train (or eval) mode."""
        return "any" if "any" in self.outputs else ("train" if training else "eval")

    def flatten(
        self,
        sample: tuple[Any, ...] | Tensor,
        kwargs: Mapping[str, Any] | None = None,
        what: str = "inputs",
    ) -> tuple[Tensor, ...]:
        """The model's inputs as the first unit takes them.

        Raises:
            ValueError: the inputs differ in structure or constants from the traced ones;
                ``what`` names them in the message.
        """
        return tuple(self.inputs.flatten(model_inputs(sample, kwargs), what))

    def check(self, tensors: Sequence[Tensor], training: bool) -> None:
        """Checks flat inputs against the shapes and dtypes the graph of this mode fixed.

        Raises:
            ValueError: an input differs where the graph fixed it.
        """
        shapes = self.shapes.get(self.key(training))
        if shapes is not None:
            shapes.check(tensors)

    def per_micro_batch(self) -> list[str]:
        """The outputs computed once per micro-batch, not per sample (0-d tensors: a loss
        the model computes), by label; the pipeline returns their mean over the samples."""
        found = {s.label(i) for s in self.outputs.values() for i, k in s.kinds.items() if k == MEAN}
        return sorted(found)

    def rebuild(self, output: Any, training: bool) -> Any:
        """The last unit's output (a tensor or a tuple of them) as the model returns it."""
        flat = (output,) if isinstance(output, Tensor) else tuple(output)
        return self.outputs[self.key(training)].rebuild(flat)


@dataclass
class SequentialModel:
    """A traced model as its units in order, ready to be profiled, planned and run.

    Attributes:
        layout: the units and the traces they were cut from.
        units: one module per unit, sharing the model's parameters.
        io: the maps between the model's inputs and outputs and the units' tensors.
    """

    layout: Layout
    units: list[UnitModule]
    io: ModelIO

    @classmethod
    def of(cls, layout: Layout) -> SequentialModel:
        """The units of ``layout``, built once (each call of ``layout.modules()`` builds new)."""
        return cls(layout, layout.modules(), ModelIO.of(layout))

    @property
    def names(self) -> list[str]:
        """The unit names (module paths), in order."""
        return self.layout.names

    @property
    def shared(self) -> list[SharedState]:
        """Parameters and buffers that several units use (see :attr:`Layout.shared`)."""
        return self.layout.shared

    @property
    def written(self) -> set[str]:
        """The names of the parameters and buffers some unit may write in place: on two
        devices they cannot be replicated."""
        return self.layout.written

    def sequential(self) -> UnitSequential:
        """The units as a :class:`UnitSequential` whose children are named after them.

        Its ``layer_names`` are the units' names (``h.3``), which profiles and plans use.
        """
        # A child name of nn.Sequential cannot hold a dot: the child keys are ``h/3``.
        names = [name.replace(".", "/") for name in self.names]
        return UnitSequential(OrderedDict(zip(names, self.units)))


def unit_sequential(
    model: nn.Module,
    sample: tuple[Any, ...] | Tensor,
    *,
    kwargs: dict[str, Any] | None = None,
    granularity: str = "blocks",
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    method: str = "auto",
    both_modes: bool = True,
) -> tuple[nn.Sequential, tuple[Tensor, ...]]:
    """The model as an ``nn.Sequential`` of its units, with the sample flattened to match.

    Each unit takes the tensors live across its input boundary and returns those live
    after it, so the Sequential can be profiled and planned like any other; its children
    are named after the units. Takes the arguments of :func:`prepare`.
    """
    layout = prepare(
        model,
        sample,
        kwargs=kwargs,
        granularity=granularity,
        leaf_modules=leaf_modules,
        method=method,
        both_modes=both_modes,
    )
    model_units = SequentialModel.of(layout)
    return model_units.sequential(), model_units.io.flatten(sample, kwargs, "sample")
