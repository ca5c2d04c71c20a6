"""Counts what one layer computes and holds without storage: FLOPs, memory traffic, bytes.

The layer runs on fake tensors (``torch._subclasses.FakeTensorMode``) that claim the
profiling device but hold no data, so a layer of a model too large for any host is
counted as cheaply as a small one, and the device's own kernels are chosen (the CPU's
fused attention, say) with its autocast rules. The bytes saved for backward are counted
by the same saved-tensor accounting the measuring profiler uses
(:meth:`profiler.layer.Pass.saved`), so they are the bytes a measurement on that device
finds.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from profiler.expert_counting import ExpertFigures, Routed, expert_figures, routed_experts
from profiler.fused_attention import FusedAttention
from profiler.layer import (
    Pass,
    as_tensors,
    state_storages,
    storage_bytes,
    storage_key,
    tensor_bytes,
    with_grad,
)
from profiler.norm_counting import NormWatch, Work
from profiler.op_flops import CPU_ATTENTION_FLOPS
from profiler.precision import autocast_pass
from profiler.shard_counting import ShardFigures, ShardFlow, saving
from profiler.up_projection_counting import UpProjectionWatch

__all__ = ["fake_inputs", "fake_state", "quiet_fakes", "swapped_state"]

META = torch.device("meta")


@dataclass(frozen=True)
class LayerCounts:
    """One layer's counts at one batch size."""

    flops: float
    backward_flops: float
    backward_input_flops: float
    traffic: float
    backward_traffic: float
    operations: int
    backward_operations: int
    saved: int
    input_saved: int  # of ``saved``: the input's storages
    output_saved: int  # of ``saved``: the output's storages
    output: int  # bytes of the output, what crosses a cut after the layer
    gemm_saved: int = 0  # of ``saved``: the activation inputs of weight GEMMs
    norm_saved: int = 0  # of ``saved``: normalization outputs (profiler.norm_counting)
    norm_flops: float = 0.0  # of ``flops``: the normalization modules' forward
    norm_traffic: float = 0.0  # of ``traffic``: the same
    norm_operations: int = 0  # of ``operations``: the same
    # Of ``saved``: tensors a latent attention's up-projections made for the attention
    # (profiler.up_projection_counting); of the forward, their region's work.
    up_proj_saved: int = 0
    up_proj_flops: float = 0.0
    up_proj_traffic: float = 0.0
    up_proj_operations: int = 0
    shards: ShardFigures | None = None  # counted with a tensor-parallel plan
    experts: ExpertFigures | None = None  # of a layer with routed experts


class Traffic(TorchDispatchMode):
    """Sums the bytes each operation reads and writes: its tensor inputs and outputs.

    That is what kernels without fusion move through memory, the figure a roofline
    estimate divides by the memory bandwidth. Views and other operations that alias their
    input move nothing and are skipped, as are queries that return no tensor (a tensor's
    device, its sizes); a tensor passed twice to one operation is read once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.operations = 0  # the operations that move bytes: a kernel launch each

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        moved = moved_bytes(func, args, kwargs, out)
        if moved is not None:
            self.operations += 1
            self.bytes += moved
        return out


def moved_bytes(func: Any, args: Any, kwargs: Any, out: Any) -> int | None:
    """The bytes one operation reads and writes (see :class:`Traffic`); ``None`` for one
    that launches no kernel."""
    results = tree_leaves(out)
    moves = any(isinstance(value, Tensor) for value in results)
    if not moves or getattr(func, "is_view", False) or func in _NO_TRAFFIC:
        return None
    total = 0
    seen: set[tuple[Any, ...]] = set()
    for value in (*tree_leaves((args, kwargs)), *results):
        if isinstance(value, Tensor):
            key = (storage_key(value)[0], value.storage_offset(), tuple(value.shape))
            if key not in seen:
                seen.add(key)
                total += value.numel() * value.element_size()
    return total


# Operations that only describe tensors or alias them; they launch no memory traffic.
# ``_unsafe_view`` is a view its schema does not mark (``reshape`` after a copy, the
# 3-d matmul's result): counted, it doubled a Linear's output bytes.
_NO_TRAFFIC = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
}


class CpuKernels(TorchDispatchMode):
    """Gives fake results the dtypes the CPU kernels give where the fake kernels differ.

    PyTorch's fake layer, group and batch norms return their statistics (mean and inverse
    deviation, saved for backward) in the input's dtype on the CPU, but the CPU kernels
    keep them in float32 when a half-precision input meets float32 weights, as under
    autocast, which leaves a norm's weights in float32: the saved bytes would come out
    short. The fake group norm's backward also returns a float32 input gradient there,
    where the kernel returns the input's dtype. The CPU embedding bag's ``offset2bag``
    (saved for backward) keeps the one extra element it was built with.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        state = _NORM_STATE.get(func)
        if state is not None and _mixed_on_cpu(args[0], [args[i] for i in state]):
            output, mean, rstd = out
            out = (output, mean.to(torch.float32), rstd.to(torch.float32))
        elif func is _GROUP_NORM_BACKWARD and _mixed_on_cpu(args[1], [args[4]]):
            grad, *rest = out
            out = (None if grad is None else grad.to(args[1].dtype), *rest)
        elif func is _EMBEDDING_BAG and out[1].device.type == "cpu" and out[1].numel():
            output, offset2bag, *rest = out
            longer = offset2bag.new_empty(offset2bag.numel() + 1)[: offset2bag.numel()]
            out = (output, longer, *rest)
        return out


def _mixed_on_cpu(x: Tensor, state: list[Any]) -> bool:
    """A half-precision CPU input with float32 weights or statistics."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float16)
        and any(isinstance(t, Tensor) and t.dtype != x.dtype for t in state)
    )


# Each norm's parameter and running-statistic arguments, whose dtype decides the kernel's.
_NORM_STATE = {
    torch.ops.aten.native_layer_norm.default: (2, 3),
    torch.ops.aten.native_group_norm.default: (1, 2),
    torch.ops.aten.native_batch_norm.default: (1, 2, 3, 4),
}
_GROUP_NORM_BACKWARD = torch.ops.aten.native_group_norm_backward.default
_EMBEDDING_BAG = torch.ops.aten._embedding_bag.default


def fresh_like(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Meta tensors with the shapes, strides, dtypes and ``requires_grad`` of ``tensors`` on
    new storages, shared as theirs are.

    What one layer passes the next must keep its layout: a transposed output (a
    batch-first LSTM's) is copied by a next layer that needs it contiguous, not saved,
    and a tensor passed on twice (or two views of one storage) is one, as in a measured run.
    """
    storages: dict[int, torch.UntypedStorage] = {}
    fresh = []
    for tensor in tensors:
        key, nbytes = storage_key(tensor)
        if key not in storages:
            storages[key] = torch.empty(nbytes, dtype=torch.uint8, device=META).untyped_storage()
        view = torch.empty(0, dtype=tensor.dtype, device=META)
        view.set_(storages[key], tensor.storage_offset(), tensor.shape, tensor.stride())
        fresh.append(with_grad(view, tensor.requires_grad))
    return tuple(fresh)


def to_meta(tensors: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """Storage-free copies of ``tensors`` on the meta device (same shapes and dtypes)."""
    return tuple(t.detach().to(META) for t in tensors)


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device.

    No storage is copied (a deep copy of a large layer would briefly double it): each
    tensor is replaced by a meta one of its shape in the copy; tied tensors stay one.
    """
    memo: dict[int, Any] = {}
    for tensor in module.parameters():
        if id(tensor) not in memo:
            empty = torch.empty_like(tensor, device=META)
            memo[id(tensor)] = nn.Parameter(empty, requires_grad=tensor.requires_grad)
    for buffer in module.buffers():
        memo.setdefault(id(buffer), torch.empty_like(buffer, device=META))
    return copy.deepcopy(module, memo)


@contextlib.contextmanager
def swapped_state(
    modules: Sequence[nn.Module], stand_in: Callable[[Tensor], Tensor | None]
) -> Iterator[None]:
    """Replaces the parameters and buffers of ``modules`` by ``stand_in(tensor)`` for the
    block (a parameter's stand-in becomes a parameter with its ``requires_grad``; ``None``
    keeps the tensor), then puts the originals back.

    A tensor several modules hold gets one stand-in.
    """
    made: dict[int, Tensor | None] = {}
    saved: list[tuple[dict[str, Any], str, Tensor]] = []
    for module in modules:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in made:
                        other = stand_in(tensor)
                        if other is not None and isinstance(tensor, nn.Parameter):
                            other = nn.Parameter(other, requires_grad=tensor.requires_grad)
                        made[id(tensor)] = other
                    replacement = made[id(tensor)]
                    if replacement is not None:
                        saved.append((table, name, tensor))
                        table[name] = replacement  # type: ignore[assignment]
    try:
        yield
    finally:
        for table, name, tensor in reversed(saved):
            table[name] = tensor


def fake_state(
    modules: Sequence[nn.Module], mode: FakeTensorMode, device: torch.device
) -> contextlib.AbstractContextManager[None]:
    """Replaces the parameters and buffers of ``modules`` by fake tensors on ``device``
    (no data: a real tensor's stand-in costs nothing) for the block, then puts them back.

    A tensor several modules hold stays one fake tensor. Run the modules inside ``mode``.
    """
    return swapped_state(modules, lambda t: FakeTensor(mode, t.detach().to(META), device))


@contextlib.contextmanager
def quiet_fakes() -> Iterator[None]:
    """Keeps torch's fake tensors from logging a traceback for an operation they cannot run
    (the error is raised anyway, and reported in one line by whoever catches it)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def fake_inputs(
    tensors: Sequence[Tensor], mode: FakeTensorMode, device: torch.device | None = None
) -> tuple[Tensor, ...]:
    """Fake copies of ``tensors`` (shapes, dtypes and ``requires_grad``, no data), on
    ``device`` or their own."""
    return tuple(
        with_grad(FakeTensor(mode, t.detach().to(META), device or t.device), t.requires_grad)
        for t in tensors
    )


def _flops(counter: FlopCounterMode) -> float:
    return float(counter.get_total_flops())


def _counter() -> FlopCounterMode:
    """torch's flop counter, which also counts the CPU's fused attention."""
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


def count_layer(
    layer: nn.Module,
    inputs: tuple[Tensor, ...],
    device: torch.device,
    *,
    label: str = "the layer",
    autocast: str | None = None,
    styles: Mapping[str, str] | None = None,
    skew: float = 1.0,
    grads: Sequence[bool] | None = None,
) -> tuple[LayerCounts, tuple[Tensor, ...], bool]:
    """Counts one layer as it would run on ``device``, without storage.

    Args:
        layer: a copy of the layer with its state on the meta device (:func:`meta_copy`);
            its state is replaced by fake tensors.
        inputs: its positional inputs, on the meta device; floating ones get gradients
            (unless ``grads`` says otherwise).
        device: the device whose kernels and autocast rules apply (it must exist here:
            ``cuda`` only where CUDA is available).
        label: how error messages name the layer.
        autocast: run the forward and backward under ``torch.autocast`` with this dtype.
        styles: the tensor-parallel style of the module owning each parameter, by its name
            in ``layer``; given (even empty), the counts include what the styles shard
            (:mod:`profiler.shard_counting`), counted in the same forward and backward.
        skew: the routing assumed for routed experts (:mod:`profiler.expert_routing`):
            1 balanced, else the busiest expert's tokens over the mean. Their figures
            are counted alone too (:attr:`LayerCounts.experts`).
        grads: which inputs require a gradient, as the model's earlier layers made them;
            ``None``: every floating one.

    Returns:
        The counts, the layer's outputs on the meta device (each requiring a gradient
        where the counted forward's did), and whether they were a tuple.

    Raises:
        RuntimeError: the layer needs tensor values (``.item()``, ``nonzero``), which fake
            tensors do not have.
    """
    counts, outputs, returns_tuple, routed = _count(
        layer, inputs, device, label, autocast, styles, skew, grads
    )

    def alone(
        block: nn.Module, given: tuple[Tensor, ...]
    ) -> tuple[float, float, float, int, float, float]:
        found = _count(block, given, device, "routed experts", autocast, None, skew)[0]
        return (
            found.flops,
            found.backward_flops,
            found.backward_input_flops,
            found.saved,
            found.traffic,
            found.backward_traffic,
        )

    figures = expert_figures(routed, alone)
    if figures is not None:
        # The routed experts' traffic as a grouped kernel moves it (expert_figures).
        forward, backward = figures.traffic_change
        counts = dataclasses.replace(
            counts,
            experts=figures,
            traffic=max(counts.traffic + forward, 0.0),
            backward_traffic=max(counts.backward_traffic + backward, 0.0),
        )
    return counts, outputs, returns_tuple


def _count(
    layer: nn.Module,
    inputs: tuple[Tensor, ...],
    device: torch.device,
    label: str,
    autocast: str | None,
    styles: Mapping[str, str] | None,
    skew: float,
    grads: Sequence[bool] | None = None,
) -> tuple[LayerCounts, tuple[Tensor, ...], bool, Routed]:
    """:func:`count_layer` without the routed experts' own figures, and what it saw of
    them."""
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = fake_inputs(inputs, mode, device)
    with (
        quiet_fakes(),
        fake_state([layer], mode, device),
        mode,
        CpuKernels(),
        FusedAttention(),
        routed_experts(layer, skew, autocast) as (routed, watch),
        watch,
    ):
        exclude = state_storages(layer)
        runs = Pass(layer, fakes, device, label, None, autocast, grads)
        saved, fresh, of_output, of_gemms = runs.saved(exclude)
        forward_flops, backward_flops = _counter(), _counter()
        forward_bytes, backward_bytes = Traffic(), Traffic()
        flow = None if styles is None else ShardFlow(layer, styles, moved_bytes)
        following = flow or contextlib.nullcontext()
        kept: list[Tensor] = []
        args = runs.arguments()

        def totals() -> Work:
            return Work(_flops(forward_flops), float(forward_bytes.bytes), forward_bytes.operations)

        norms, up = NormWatch(layer, totals), UpProjectionWatch(layer, totals)
        # The up-projections' watch last: it reads the counters around each operation.
        with (
            forward_flops,
            forward_bytes,
            following,
            saving(kept),
            norms.watching(),
            up.watching(),
        ):
            targets = runs.forward(args)
        of_norms = norms.saved_outputs(kept)
        norm_saved = storage_bytes(of_norms, exclude)
        # A norm inside the region (none in the MLA attentions known) is the norms' to free.
        up_saved = storage_bytes(
            up.saved_outputs(kept), exclude | {storage_key(t)[0] for t in of_norms}
        )
        if flow is not None:
            flow.leave(targets)
            flow.saved(kept, exclude)
            flow.backward = True
        kept.clear()
        with backward_flops, backward_bytes, following:
            runs.backward(targets)
        input_flops = _counter()
        # The input gradient's sharded part, followed through the pass that counts it.
        input_flow = None if styles is None else ShardFlow(layer, styles, moved_bytes)
        following = input_flow or contextlib.nullcontext()
        args = runs.arguments()
        with following:
            targets = runs.forward(args)
        if input_flow is not None:
            input_flow.leave(targets)
            input_flow.backward = True
        wanted = [a for a in args if a.requires_grad]
        if targets and wanted:
            with input_flops, following, autocast_pass(device.type, autocast):
                torch.autograd.grad(targets, wanted, runs.grads, allow_unused=True)
        del targets, args
        # What the next layer gets: the outputs as the model passes them, without autograd,
        # computed from the inputs themselves so that an input passed through stays the
        # same tensor (the measuring pass counts a tensor returned twice once).
        with torch.no_grad(), autocast_pass(device.type, autocast):
            raw = layer(*fakes)
        # Requiring a gradient where the counted forward's outputs did: what the next
        # layer's inputs require.
        plain = as_tensors(raw, f"the output of {label}")
        outputs = tuple(with_grad(t, g) for t, g in zip(plain, runs.output_grads, strict=True))
        returns_tuple = not isinstance(raw, Tensor)
        output_bytes = tensor_bytes(outputs)
        metas = fresh_like(outputs)
    counts = LayerCounts(
        flops=_flops(forward_flops),
        backward_flops=_flops(backward_flops),
        backward_input_flops=min(_flops(input_flops), _flops(backward_flops)),
        traffic=float(forward_bytes.bytes),
        backward_traffic=float(backward_bytes.bytes),
        operations=forward_bytes.operations,
        backward_operations=backward_bytes.operations,
        saved=saved,
        input_saved=saved - fresh,
        output_saved=of_output,
        output=output_bytes,
        gemm_saved=of_gemms,
        norm_saved=min(norm_saved, saved),
        norm_flops=norms.flops,
        norm_traffic=norms.traffic,
        norm_operations=norms.operations,
        up_proj_saved=min(up_saved, saved),
        up_proj_flops=up.flops,
        up_proj_traffic=up.traffic,
        up_proj_operations=up.operations,
        shards=None if flow is None else flow.finish(input_flow),
    )
    return counts, metas, returns_tuple, routed
