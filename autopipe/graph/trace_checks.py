"""The checks a trace must pass: the graph computes the model's outputs, and gives gradients
where the model does."""

from __future__ import annotations

import warnings
from typing import Any

import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe.graph.meta import meta_construct
from autopipe.graph.values import GradModeInterpreter, gradient_flow, run_quietly, same_results
from profiler import fake_inputs, fake_state, quiet_fakes

__all__: list[str] = []  # internal to the package

PREFIX = "model"  # the traced root holds the model under this name


def verify_outputs(
    flat: nn.Module,
    tensors: tuple[Tensor, ...],
    result: tuple[Any, dict[int, Tensor]],
    name: str,
) -> bool:
    """Checks that the graph computes the model's outputs and buffer updates on the sample.

    torch.fx can trace the wrong branch (``isinstance`` on a proxy) or run code eagerly
    instead of recording it without noticing; a mismatch makes fx fail so that export is
    tried. Export's graph is trusted but warned about. On meta only shapes and dtypes are
    compared; when the model's own code cannot run there (it reads values), fx's graph is
    refused and export's kept unchecked.

    Returns:
        Whether the graph was checked (``False``: export's graph, the model not runnable).
    """
    try:
        expected = run_quietly(flat, flat, *tensors)
    except Exception as exc:
        construct = meta_construct(exc) if tensors and tensors[0].is_meta else None
        if construct is None:
            raise
        if name == "fx":
            raise ValueError(
                f"the model's code cannot run on the meta device ({construct}), so the fx "
                "graph cannot be checked"
            ) from exc
        return False
    if same_results(result, expected):
        return True
    message = (
        f"the {name} graph does not compute the model's outputs or buffer updates on the "
        "sample (Python code that depends on the tracer, e.g. isinstance checks on tensors?)"
    )
    if name == "fx":
        raise ValueError(message)
    warnings.warn(f"wrap(): {message}", stacklevel=4)
    return True


class GradientMismatch(ValueError):
    """The graph gives gradients elsewhere than the model."""


def verify_gradients(
    flat: nn.Module, root: nn.Module, graph: fx.Graph, tensors: tuple[Tensor, ...], name: str
) -> None:
    """Checks that the graph's outputs require a gradient, and its parameters and inputs
    receive one, exactly where the model's do (a lost ``torch.no_grad()`` region would
    train what the model freezes).

    Which tensors get a gradient is decided by the code, not by the values, so both are
    asked on fake stand-ins of the sample and the state first (shapes without data, on the
    sample's device), where a backward costs nothing (on the sample a deep model's two
    backwards were the longest part of its trace); on the sample itself only when the
    model's code cannot run on fake tensors.

    Raises:
        ValueError: they differ; the message names the first difference.
    """
    interpreter = GradModeInterpreter(root, graph=graph)
    expected = None
    if not any(t.is_meta for t in tensors):
        device = tensors[0].device
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        stand_ins = fake_inputs(tensors, mode)
        with quiet_fakes(), fake_state([flat, root], mode, device), mode:
            expected = gradient_flow(flat, flat, stand_ins)
            if expected is not None:
                got = gradient_flow(flat, interpreter.run, stand_ins)
    if expected is None:
        expected = gradient_flow(flat, flat, tensors)
        if expected is None:  # the model itself cannot back-propagate on the sample
            return
        got = gradient_flow(flat, interpreter.run, tensors)
    if got == expected:
        return
    if got is None:
        raise GradientMismatch(f"the {name} graph cannot back-propagate on the sample")
    where = next(k for k in expected if got.get(k) != expected[k])
    verb = "requires" if where.startswith("output") else "receives"
    ours = f"{verb} a gradient" if got.get(where) else f"does not {verb[:-1]} a gradient"
    raise GradientMismatch(
        f"{where.removeprefix(PREFIX + '.')} {ours} in the {name} graph, unlike in the model: "
        "the graph lost a grad-mode region of its code (a torch.no_grad() or enable_grad() "
        "block the tracer did not see)"
    )
