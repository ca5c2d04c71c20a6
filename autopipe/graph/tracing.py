"""Tracing a model into one fx graph: torch.fx first, torch.export (non-strict) as the fallback."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from autopipe import TracingError
from autopipe.graph.batch_outputs import batch_major_outputs
from autopipe.graph.export import (
    check_symbolic_batch,
    drop_constant_copies,
    export_graph,
    strip_checks,
)
from autopipe.graph.flat_io import FlatSpec, check_batch_major
from autopipe.graph.grad_modes import KEY, inline_grad_regions, tracking
from autopipe.graph.meta import META, has_meta_state, meta_shadow, rebind_state
from autopipe.graph.repeats import cut, extend, find_repeats
from autopipe.graph.shapes import DynamicSpec, InputShapes, dynamic_dims, input_names
from autopipe.graph.trace_checks import PREFIX, verify_gradients, verify_outputs
from autopipe.graph.trace_errors import failure_message
from autopipe.graph.values import ValueInfo, record_values

__all__ = ["METHODS", "PREFIX", "Traced", "trace"]

METHODS = ("auto", "fx", "export")


_output_spec = threading.local()


@dataclass
class Traced:
    """A model traced into a flat fx graph.

    The graph takes the model's tensor inputs as placeholders, in :attr:`inputs` order, and
    returns its tensor outputs as a flat tuple, in :attr:`outputs` order; non-tensor inputs
    were baked in as constants.

    Attributes:
        model: the traced model.
        root: the module the graph's ``get_attr``/``call_module`` targets resolve in: the
            model's modules or tensors appear under ``model.`` (the same objects), the
            trace's constants elsewhere.
        graph: the graph.
        method: ``fx`` or ``export``.
        inputs: the structure of ``(args, kwargs)``.
        outputs: the structure of the model's output (``kinds``: 0-d and several-rows
            outputs, which the graph returns batch-major).
        values: what each node held on the sample, by node name.
        batch: the sample's batch size.
        training: the mode the model was traced in.
        device: a device that export baked into the graph (the sample's) and that each stage
            must replace by its own, or ``None``.
        shapes: the input shapes and dtypes an export graph holds (``None`` for fx, whose
            graph keeps every size symbolic), to check each call's inputs against.
    """

    model: nn.Module
    root: nn.Module
    graph: fx.Graph
    method: str
    inputs: FlatSpec
    outputs: FlatSpec
    values: dict[str, ValueInfo]
    batch: int
    training: bool
    device: torch.device | None = None
    shapes: InputShapes | None = None

    def code(self) -> str:
        """The graph's Python code, to compare traces, with the grad mode of its nodes."""
        modes = [f"{n.name}={n.meta[KEY]}" for n in self.graph.nodes if n.meta.get(KEY) is not None]
        return self.graph.python_code("self").src + "".join(f"\n# grad {m}" for m in modes)


class _FlatModel(nn.Module):
    """Calls the model on flat tensors and returns the flat leaves of its output."""

    def __init__(self, model: nn.Module, inputs: FlatSpec) -> None:
        super().__init__()
        self.add_module(PREFIX, model)
        self.inputs = inputs

    def forward(self, *tensors: Any) -> tuple[Any, ...]:
        args, kwargs = self.inputs.rebuild(tensors)
        output = getattr(self, PREFIX)(*args, **kwargs)
        leaves, spec = torch.utils._pytree.tree_flatten(output)
        # Export restores the module's attributes after tracing: record the spec elsewhere.
        _output_spec.value = spec
        return tuple(leaves)


class _Tracer(fx.Tracer):
    """An fx tracer with user leaf modules and one placeholder per flat input."""

    def __init__(self, count: int, leaves: Sequence[str | type[nn.Module]]) -> None:
        super().__init__()
        self.count = count
        self.leaf_types = tuple(t for t in leaves if isinstance(t, type))
        self.leaf_names = {f"{PREFIX}.{t}" for t in leaves if isinstance(t, str)}
        self.failed_in: tuple[str, str] | None = None
        # Buffers become graph values too, so that in-place updates are recorded.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or isinstance(m, self.leaf_types):
            return True
        if module_qualified_name == PREFIX:  # the model itself, even a torch.nn one
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def create_args_for_root(
        self, root_fn: Callable[..., Any], is_module: bool, concrete_args: Any = None
    ) -> tuple[Any, list[Any]]:
        proxies = [
            self.create_proxy("placeholder", f"input_{i}", (), {}) for i in range(self.count)
        ]
        return root_fn, [self.root, *proxies]

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module is the first to see it
                path = self.path_of_module(m).removeprefix(PREFIX).removeprefix(".")
                if path:
                    self.failed_in = (path, type(m).__name__)
            raise


def _trace_fx(flat: _FlatModel, count: int, leaves: Sequence[Any]) -> fx.Graph:
    tracer = _Tracer(count, leaves)
    try:
        with _state_kept(flat):
            return tracer.trace(flat)
    except Exception as exc:
        exc.autopipe_module = tracer.failed_in  # type: ignore[attr-defined]
        raise


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Puts back what tracing changed in the model's modules: parameters, buffers, tensor
    attributes and Python numbers, and drops the proxies and fake tensors it added.

    Tracing runs the model's own code on proxies (torch.fx) or fake tensors (torch.export),
    and the checks run it for real: ``self.count += 1`` on a buffer (fx leaves a proxy
    there, breaking the model for every later run), ``self.last = h.detach()`` (export
    leaves a fake tensor) or ``self.calls += 1`` on a Python number would outlive the
    trace. Other attributes the code adds stay: libraries mark a module once they have
    installed hooks on it (Hugging Face's output capturing), and dropping the mark while
    the hooks stay would install them twice.
    """
    kept = [
        (
            module,
            dict(module._parameters),
            dict(module._buffers),
            {k: v for k, v in module.__dict__.items() if _put_back(v)},
            set(module.__dict__),
        )
        for module in model.modules()
    ]
    try:
        yield
    finally:
        for module, parameters, buffers, attributes, names in kept:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
            for name in set(module.__dict__) - names:  # attributes the trace added
                if isinstance(module.__dict__[name], (fx.Proxy, FakeTensor)):
                    del module.__dict__[name]
            module.__dict__.update(attributes)


def _put_back(value: Any) -> bool:
    """Whether an attribute's value is put back after the trace: tensors, ``None`` and
    numbers (not flags: a flag may mark work done once, as the added attributes above)."""
    if isinstance(value, bool):
        return False
    return value is None or isinstance(value, (Tensor, int, float))


def _outputs(flat: _FlatModel, graph: fx.Graph, values: dict[str, ValueInfo]) -> FlatSpec:
    """Makes the graph return only its tensor outputs; their structure, with the constants."""
    (output,) = graph.find_nodes(op="output")
    returned = list(output.args[0])
    leaves: list[Any] = []
    tensors: list[fx.Node] = []
    for i, value in enumerate(returned):
        if isinstance(value, fx.Node):
            if values[value.name].kind != "tensor":
                raise ValueError(
                    f"output leaf {i} of the model is a {values[value.name].type_name} computed "
                    "from the inputs; wrap() needs batch-major tensor outputs"
                )
            tensors.append(value)
            leaves.append(None)
        else:
            leaves.append(value)
    output.args = (tuple(tensors),)
    with_paths = torch.utils._pytree.tree_flatten_with_path(
        torch.utils._pytree.tree_unflatten(list(range(len(leaves))), _output_spec.value)
    )[0]
    labels = [torch.utils._pytree.keystr(path) for path, _ in with_paths]
    slots = [i for i, v in enumerate(returned) if isinstance(v, fx.Node)]
    return FlatSpec(_output_spec.value, leaves, slots, labels)


def trace(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    leaf_modules: Iterable[str | type[nn.Module]] = (),
    method: str = "auto",
    dynamic: DynamicSpec | None = None,
) -> Traced:
    """Traces ``model(*args, **kwargs)`` into a graph over its tensor inputs and outputs.

    torch.fx's symbolic tracing is tried first; when it fails (Python control flow on
    tensor values or shapes...), torch.export in non-strict mode, with a dynamic batch
    dimension. The model is traced in the mode it is in and left unchanged; a Hugging Face
    model is traced with its cache off (``config.use_cache`` is ``False`` for the trace):
    the graph returns no ``past_key_values``.

    A model whose parameters or buffers are on the meta device (all or some of them) is
    traced on meta, with the sample moved there: real tensors are stood in for by meta ones
    during the trace, and the graph reads the model's own tensors afterwards. Meta tensors
    hold no values, so the checks of the graph against the model compare less there: the
    outputs' and buffers' shapes and dtypes, not their values, and which outputs require a
    gradient and which parameters and inputs receive one (when the model's own code runs on
    meta; where it cannot, e.g. a check on the values of a tensor made from constants that
    torch.export resolved, torch.fx's graph is refused and torch.export's kept unchecked).
    Code that needs tensor values (``Tensor.item()``, ``torch.nonzero``) cannot be traced
    on meta.

    Args:
        model: the model.
        args: its positional inputs; tensors become graph inputs, other values constants.
        kwargs: its keyword inputs, treated like ``args``.
        leaf_modules: submodule names or classes that torch.fx keeps as single opaque calls.
        method: ``auto``, ``fx`` or ``export``.
        dynamic: the dims besides the batch that may vary, by input (see
            :func:`autopipe.wrap`); export fixes every other size at the sample's.

    Raises:
        TracingError: neither tracer could trace the model; the message names the
            construct and a fix (on meta: the construct that needs tensor values).
        ValueError: the inputs or outputs are not batch-major tensors, or bad arguments.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    inputs, tensors = FlatSpec.of((tuple(args), dict(kwargs or {})), top=("args", "kwargs"))
    labels = [inputs.label(i) for i in range(len(tensors))]
    batch = check_batch_major([tuple(t.shape) for t in tensors], labels, "inputs")
    flat = _FlatModel(model, inputs)
    names = input_names(model, inputs)
    dims = (dynamic_dims(model, inputs, tensors, dynamic), names)
    meta = has_meta_state(model)
    if meta:
        tensors = tuple(t.to(META) for t in tensors)
    with (
        torch.enable_grad(),
        _without_cache(model),
        meta_shadow(model) if meta else _nothing(),
        _state_kept(model),
    ):
        traced = _trace(model, flat, tensors, inputs, batch, list(leaf_modules), method, dims)
    if meta:  # export's graph module holds the stand-ins of the real tensors
        rebind_state(traced.root, model, PREFIX)
    return traced


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def _without_cache(model: nn.Module) -> Iterator[None]:
    """Turns the key/value cache of Hugging Face models off for the trace, then back on.

    Training needs no cache, and a cache object cannot leave a graph.
    """
    found: Iterator[Any] = (getattr(m, "config", None) for m in model.modules())
    configs = {id(c): c for c in found if getattr(c, "use_cache", None) is True}
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


def _checked(
    root: nn.Module, graph: fx.Graph, flat: _FlatModel, tensors: tuple[Tensor, ...], name: str
) -> dict[str, ValueInfo]:
    """Records what each node holds on the sample and checks the graph against the model
    (without dropping the constant copies the checks' fake runs need)."""
    strip_checks(graph)
    values, output, buffers = record_values(root, graph, tensors)
    # False: the model cannot run on meta, export's graph is kept unchecked.
    if verify_outputs(flat, tensors, (output, buffers), name):
        verify_gradients(flat, root, graph, tensors, name)
    return values


def _exported(
    root: nn.Module, graph: fx.Graph, shapes: InputShapes, values: dict[str, ValueInfo]
) -> tuple[nn.Module, fx.Graph, InputShapes, dict[str, ValueInfo]]:
    drop_constant_copies(graph)
    return root, graph, shapes, values


def _export(
    model: nn.Module,
    flat: _FlatModel,
    tensors: tuple[Tensor, ...],
    dynamic: tuple[list[dict[int, Any]], list[tuple[str | int, str]]],
) -> tuple[nn.Module, fx.Graph, InputShapes, dict[str, ValueInfo]]:
    """:func:`export_graph` of the flat model, checked; a long list of alike blocks is
    exported cut to a few and its graph extended (:mod:`autopipe.graph.repeats`).

    A model with real tensors is checked whole (its values compared); on meta, where the
    checks compare shapes and which tensors take gradients, the same in every alike
    block, the cut model's graph is.
    """
    repeats = find_repeats(model)
    if repeats is not None:
        meta = any(t.is_meta for t in tensors)
        with cut(model, repeats):
            root, graph, shapes = _export_graph(flat, tensors, dynamic)
            values = _checked(root, graph, flat, tensors, "export") if meta else {}
        if extend(graph, root, model, repeats, PREFIX):
            graph.lint()
            root.graph = graph  # type: ignore[assignment]
            if meta:
                values = record_values(root, graph, tensors)[0]
            else:
                values = _checked(root, graph, flat, tensors, "export")
            return _exported(root, graph, shapes, values)
    root, graph, shapes = _export_graph(flat, tensors, dynamic)
    return _exported(root, graph, shapes, _checked(root, graph, flat, tensors, "export"))


def _export_graph(
    flat: _FlatModel,
    tensors: tuple[Tensor, ...],
    dynamic: tuple[list[dict[int, Any]], list[tuple[str | int, str]]],
) -> tuple[nn.Module, fx.Graph, InputShapes]:
    """:func:`export_graph` with the model's no_grad / enable_grad regions kept."""
    with tracking():
        root, graph, shapes = export_graph(flat, tensors, *dynamic)
        inline_grad_regions(root, graph)
    return root, graph, shapes


def _trace(
    model: nn.Module,
    flat: _FlatModel,
    tensors: tuple[Tensor, ...],
    inputs: FlatSpec,
    batch: int,
    leaves: list[Any],
    method: str,
    dynamic: tuple[list[dict[int, Any]], list[tuple[str | int, str]]],
) -> Traced:
    errors: list[tuple[str, BaseException]] = []
    root: nn.Module
    exported: InputShapes | None = None
    for name in ("fx", "export") if method == "auto" else (method,):
        try:
            if name == "fx":
                with tracking():  # keeps the model's no_grad / enable_grad regions
                    root, graph = flat, _trace_fx(flat, len(tensors), leaves)
                values = _checked(root, graph, flat, tensors, name)
                # After the checks: their fake run needs the copies of plain-tensor constants.
                drop_constant_copies(graph)
            else:
                root, graph, exported, values = _export(model, flat, tensors, dynamic)
            break
        except Exception as exc:
            errors.append((name, exc))
    else:
        raise TracingError(failure_message(model, errors)) from errors[-1][1]
    outputs = _outputs(flat, graph, values)
    out_labels = [outputs.label(i) for i in range(len(outputs.slots))]
    # 0-d outputs and outputs of several rows per sample travel batch-major (an fx graph
    # keeps no sizes: run again on part of the sample to check them).
    sample = (root, tensors) if name == "fx" else None
    outputs.kinds = batch_major_outputs(graph, values, batch, out_labels, sample)
    shapes = [values[n.name].shape or () for n in graph.find_nodes(op="output")[0].args[0]]
    size = check_batch_major(shapes, out_labels, "outputs")
    if size != batch:
        raise ValueError(
            f"the outputs have {size} rows along dim 0 but the batch has {batch}; wrap() "
            "needs batch-major outputs"
        )
    if name == "export":
        check_symbolic_batch(graph, out_labels)
    device = tensors[0].device if name == "export" else None
    training = model.training
    exported = exported if name == "export" else None
    return Traced(
        model, root, graph, name, inputs, outputs, values, batch, training, device, exported
    )
