"""What each value of a traced graph holds on the sample: tensor or not, bytes, shape."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.grad_modes import grad_mode_of

__all__: list[str] = []  # internal to the package

_SIMPLE = (
    int,
    float,
    bool,
    str,
    type(None),
    type(Ellipsis),
    slice,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    torch.SymInt,
    torch.SymFloat,
    torch.SymBool,
)


@dataclass(frozen=True)
class ValueInfo:
    """What one graph value held when the sample ran through the graph.

    Attributes:
        kind: ``tensor``; ``simple`` for sizes, numbers, dtypes and other cheap Python values
            that a stage can recompute; ``other`` for the rest (tuples of tensors...).
        type_name: the Python type of the value.
        nbytes: bytes of a tensor, else 0.
        shape: the shape of a tensor, else ``None``.
    """

    kind: str
    type_name: str
    nbytes: int = 0
    shape: tuple[int, ...] | None = None

    @staticmethod
    def of(value: Any) -> ValueInfo:
        """Describes a value."""
        if isinstance(value, Tensor):
            nbytes = value.numel() * value.element_size()
            return ValueInfo("tensor", type(value).__name__, nbytes, tuple(value.shape))
        kind = "simple" if _is_simple(value) else "other"
        return ValueInfo(kind, type(value).__name__)


def _is_simple(value: Any) -> bool:
    if isinstance(value, (tuple, list)):  # torch.Size included
        return all(_is_simple(v) for v in value)
    return isinstance(value, _SIMPLE)


def run_quietly(
    module: nn.Module, function: Callable[..., Any], *tensors: Tensor, grad: bool = False
) -> tuple[Any, dict[int, Tensor]]:
    """Calls ``function`` on copies of ``tensors`` without leaving a trace.

    No autograd graph is recorded (unless ``grad``), random numbers come from a forked
    generator (two calls draw the same ones), and the module's buffers (batch-norm
    statistics) are put back.

    Returns:
        What ``function`` returned, and copies of the module's buffers as the call left
        them, by the identity of each buffer.
    """
    buffers = list(module.buffers())
    saved = [b.detach().clone() for b in buffers]
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(grad):
        try:
            result = function(*(t.clone() for t in tensors))
            return result, {id(b): b.detach().clone() for b in buffers}
        finally:
            with torch.no_grad():
                for buffer, value in zip(buffers, saved):
                    buffer.copy_(value)


class GradModeInterpreter(fx.Interpreter):
    """Runs a traced graph with each node in the grad mode the model's code set for it."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        self.outer = torch.is_grad_enabled()
        return super().run(*args, **kwargs)

    def run_node(self, n: fx.Node) -> Any:
        mode = grad_mode_of(n)
        with torch.set_grad_enabled(self.outer if mode is None else mode):
            return super().run_node(n)


def gradient_flow(
    module: nn.Module, function: Callable[..., Any], tensors: tuple[Tensor, ...]
) -> dict[str, bool] | None:
    """Which outputs of ``function`` require a gradient, and which of the module's
    parameters and of the floating-point ``tensors`` receive one from its outputs' sum.

    Runs like :func:`run_quietly`, with autograd on.

    Returns:
        ``{"output 0": ..., "input 0": ..., "<parameter name>": ...}``, or ``None`` when
        the call or its backward raises.
    """
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]

    def run(*copies: Tensor) -> dict[str, bool]:
        leaves = [c.requires_grad_() if c.is_floating_point() else c for c in copies]
        # In-place code may not modify a leaf that requires grad: pass copies of the leaves.
        outputs = function(*(c.clone() for c in leaves))
        tensors = [o for o in outputs if isinstance(o, Tensor)]
        flow = {f"output {i}": o.requires_grad for i, o in enumerate(tensors)}
        wanted = [o.float().sum() for o in tensors if o.requires_grad]
        targets = [p for _, p in params] + [c for c in leaves if c.requires_grad]
        names = [n for n, _ in params] + [
            f"input {i}" for i, c in enumerate(leaves) if c.requires_grad
        ]
        got: list[Tensor | None] = [None] * len(targets)
        if wanted and targets:
            got = list(torch.autograd.grad(wanted, targets, allow_unused=True))
        flow.update((name, g is not None) for name, g in zip(names, got))
        return flow

    try:
        flow, _ = run_quietly(module, run, *tensors, grad=True)
    except Exception:
        return None
    return flow


def record_values(
    root: nn.Module, graph: fx.Graph, tensors: tuple[Tensor, ...]
) -> tuple[dict[str, ValueInfo], Any, dict[int, Tensor]]:
    """Runs the sample through the graph and describes every value, by node name.

    The run leaves no trace (see :func:`run_quietly`).

    Returns:
        The description of each value, what the graph returned, and the buffers it left.
    """
    values: dict[str, ValueInfo] = {}

    class Recorder(GradModeInterpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            values[n.name] = ValueInfo.of(result)
            return result

    output, buffers = run_quietly(root, Recorder(root, graph=graph).run, *tensors)
    return values, output, buffers


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, Tensor):
        return not isinstance(b, Tensor)
    if isinstance(b, Tensor) and (a.is_meta or b.is_meta):  # no values: shape and dtype
        return a.shape == b.shape and a.dtype == b.dtype
    return (
        isinstance(b, Tensor)
        and a.shape == b.shape
        and torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True)
    )


def same_results(
    result: tuple[Any, dict[int, Tensor]], expected: tuple[Any, dict[int, Tensor]]
) -> bool:
    """Whether two :func:`run_quietly` results agree: outputs and buffers, to rounding.

    Meta tensors hold no values: only their shapes and dtypes are compared.
    """
    (output, buffers), (wanted, wanted_buffers) = result, expected
    if len(output) != len(wanted) or not all(map(_close, output, wanted)):
        return False
    return all(_close(buffers.get(key), value) for key, value in wanted_buffers.items())
