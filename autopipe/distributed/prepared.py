"""Any model as the layers of a distributed pipeline: unit Sequential, flat I/O, original names."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from autopipe.graph import SequentialModel, prepare

__all__: list[str] = []  # internal to the distributed runner


def _identity(value: Any) -> Any:
    return value


def _as_is(output: Any, training: bool) -> Any:
    return output


@dataclass
class Prepared:
    """A model ready to be split into pipeline stages.

    Attributes:
        sequential: the layers, in order; an ``nn.Sequential`` model itself, or the units of
            an auto-wrapped one (each takes and returns the tensors live across its cuts).
        sample: the sample as ``sequential`` takes it.
        flatten: turns the model's inputs into ``sequential``'s.
        rebuild: ``rebuild(output, training)`` turns the last layer's output into the
            model's (what ``loss_fn`` receives).
        wrapped: whether the model was auto-wrapped.
        written: ``id`` of the buffers that several units use and some unit may write
            (found in the traced graph); ``None`` when the model's code is not known, so
            any buffer may be written.
        owner: the model the layers come from, whose names a profile gives the tensors
            several layers use (``None``: the layers' own names).
        per_micro_batch: the model's outputs computed once per micro-batch (0-d tensors: a
            loss or a router's auxiliary loss the model computes), by label.
    """

    sequential: nn.Sequential
    sample: Any
    flatten: Callable[[Any], Any] = _identity
    rebuild: Callable[[Any, bool], Any] = _as_is
    wrapped: bool = False
    written: frozenset[int] | None = None
    owner: nn.Module | None = None
    per_micro_batch: tuple[str, ...] = ()


def _one_input(inputs: Any, what: str) -> Any:
    """A plain ``nn.Sequential``'s one input, from the positional inputs ``inputs``.

    Like any model's, a sample (and a step's inputs) is the model's positional inputs,
    ``model(*sample)``, and ``nn.Sequential`` takes one: ``x`` or ``(x,)`` is ``x``, and
    ``((a, b),)`` gives the first layer the tuple ``(a, b)`` as one value.

    Raises:
        ValueError: several positional inputs, which ``nn.Sequential`` cannot take.
    """
    if not isinstance(inputs, (tuple, list)):
        return inputs
    if len(inputs) > 1:
        verb = "are" if what.endswith("s") else "is"
        raise ValueError(
            f"an nn.Sequential takes one input, not {len(inputs)} (the {what} {verb} the "
            f"model's positional inputs, model(*{what})): pass ((a, b),) to give its first "
            "layer the tuple as one value, or a model whose forward takes the inputs"
        )
    return inputs[0] if inputs else inputs


def prepare_model(model: nn.Module, sample: Any) -> Prepared:
    """The model as an ``nn.Sequential``: itself, or its units (:mod:`autopipe.graph.sequential`).

    :attr:`Prepared.sample` is what the first layer takes as its one argument: a plain
    ``nn.Sequential``'s one input, or the flat input tensors of a wrapped model's units.

    Raises:
        ValueError: the model is not an ``nn.Sequential`` and cannot be wrapped, or an
            ``nn.Sequential`` is given several inputs.
    """
    if isinstance(model, nn.Sequential):
        if type(model).forward is not nn.Sequential.forward:
            return Prepared(model, sample)  # a forward of its own: the layers take the tuple
        return Prepared(model, _one_input(sample, "sample"), lambda x: _one_input(x, "inputs"))
    advice = "pass an nn.Sequential whose children are the layers to split"
    if not isinstance(sample, (Tensor, tuple)):
        raise ValueError(
            f"cannot wrap {type(model).__name__} with a {type(sample).__name__} sample; {advice}"
        )
    args = sample if isinstance(sample, tuple) else (sample,)
    try:
        layout = prepare(model, args)
    except Exception as exc:
        raise ValueError(
            f"cannot split {type(model).__name__} into stages automatically ({exc}); {advice}"
        ) from exc
    units = SequentialModel.of(layout)
    io = units.io
    # The shared state the trace reports is the parameters and the buffers it may write.
    named = dict(model.named_buffers(remove_duplicate=False))
    written = frozenset(id(named[s.name]) for s in units.shared if s.name in named)
    sequential = units.sequential()
    return Prepared(
        sequential,
        io.flatten(sample),
        io.flatten,
        io.rebuild,
        True,
        written,
        owner=model,
        per_micro_batch=tuple(io.per_micro_batch()),
    )


def original_names(stage: nn.Module, model: nn.Module) -> dict[str, str]:
    """Maps the stage's ``state_dict`` keys to the original model's, by tensor identity.

    Call it before the stage is moved (moving replaces buffers). Keys of tensors the model
    does not own keep their name.
    """
    owners = tensor_names(model)
    state = stage.state_dict(keep_vars=True)
    return {key: owners.get(id(value), key) for key, value in state.items()}


def tensor_names(model: nn.Module) -> dict[int, str]:
    """Each tensor's first name in the model (a tied tensor has several), by ``id``."""
    owners: dict[int, str] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        owners.setdefault(id(tensor), name)
    return owners


def state_keys(model: nn.Module) -> list[tuple[str, str]]:
    """The model's ``state_dict`` keys, each with the name :func:`original_names` gives
    its tensor: the tensor's first name, which a tied tensor's other keys share."""
    owners = tensor_names(model)
    state = model.state_dict(keep_vars=True)
    return [(key, owners.get(id(value), key)) for key, value in state.items()]


def unheld_state(model: nn.Module, layers: Sequence[nn.Module]) -> OrderedDict[str, Tensor]:
    """The tensors of the model's ``state_dict`` that none of ``layers`` holds (no unit
    reads them), by the names :func:`original_names` gives, leaving out those on meta.

    Nothing trains or writes them, so each rank's are the model's values; the gathered
    state dict takes them from the ranks where they are not on meta.
    """
    held = {id(t) for layer in layers for t in layer.state_dict(keep_vars=True).values()}
    held |= {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    owners = tensor_names(model)
    unheld: OrderedDict[str, Tensor] = OrderedDict()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in held and not value.is_meta:
            unheld.setdefault(owners.get(id(value), key), value)
    return unheld
