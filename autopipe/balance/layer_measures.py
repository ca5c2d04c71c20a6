"""What torchgpipe's balancers measure per layer: time of forward and backward, and memory.

Every layer runs as a copy on the measuring device, in training mode, so the model itself
(its parameters, buffers such as batch-norm statistics, its mode and device) is left as it
was, and so is the random number generator.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from profiler import state_storages, storage_bytes, storage_key, synchronize

__all__ = ["layer_sizes", "layer_times", "layerwise_sandbox"]

TensorOrTensors = Tensor | tuple[Tensor, ...]


def layerwise_sandbox(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    """Yields a copy of each layer of ``module``, on ``device`` and in training mode.

    Args:
        module: the model; not modified.
        device: where the copies live.
    """
    for layer in module:
        replica = copy.deepcopy(layer)
        replica.to(device)
        replica.train()
        yield replica


def _tensors(value: Any, what: str) -> tuple[Tensor, ...]:
    if isinstance(value, Tensor):
        return (value,)
    if isinstance(value, tuple) and value and all(isinstance(v, Tensor) for v in value):
        return value
    raise TypeError(f"{what} must be a tensor or a tuple of tensors, got {type(value).__name__}")


def _fresh(value: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    """``value`` on ``device``, cut from any graph, keeping which tensors need gradients."""

    def one(t: Tensor) -> Tensor:
        return t.detach().to(device).requires_grad_(t.requires_grad)

    return tuple(one(t) for t in value) if isinstance(value, tuple) else one(value)


def _check(module: nn.Module) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"module must be nn.Sequential to be balanced, got {type(module).__name__}; "
            "autopipe.wrap splits and balances any other module"
        )
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError(
            "some parameter already has gradient: clear them first "
            "(module.zero_grad(set_to_none=True))"
        )


def _unchanged_rng(device: torch.device) -> contextlib.AbstractContextManager[None]:
    # Dropout in the measured layers draws numbers; training must see the same ones.
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def layer_times(
    module: nn.Sequential, sample: TensorOrTensors, timeout: float, device: torch.device
) -> list[float]:
    """Seconds of each layer's forward and backward on ``sample``, averaged over passes.

    Passes over all the layers repeat while ``timeout`` seconds have not passed (one pass
    at least), as torchgpipe's ``balance_by_time`` does. Each layer's backward gets its
    outputs as their own gradients.

    Args:
        module: the model; not modified.
        sample: the input of the first layer (a tuple is one value, as in ``nn.Sequential``).
        timeout: seconds after which no new pass starts.
        device: where the layers run.

    Returns:
        One time per layer, in seconds.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a layer's output is not a
            tensor or a tuple of tensors.
        ValueError: a parameter of ``module`` already has a gradient.
    """
    _check(module)
    _tensors(sample, "the sample")
    totals = [0.0] * len(module)
    passes = 0
    begun = time.perf_counter()
    with _unchanged_rng(device):
        while passes == 0 or time.perf_counter() - begun < timeout:
            value = _fresh(sample, device)
            for i, layer in enumerate(layerwise_sandbox(module, device)):
                value = _fresh(value, device)
                synchronize(device)
                tick = time.perf_counter()
                value = layer(value)
                outputs = [t for t in _tensors(value, f"layer {i}'s output") if t.requires_grad]
                if outputs:
                    torch.autograd.backward(outputs, outputs)
                synchronize(device)
                totals[i] += time.perf_counter() - tick
            passes += 1
    return [total / passes for total in totals]


class _Saved:
    """The tensors autograd saves for backward while the block runs."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: Tensor) -> Tensor:
        self.tensors.append(tensor)
        return tensor

    def __enter__(self) -> _Saved:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._hooks.__exit__(*exc_info)


def _kept_bytes(layer: nn.Module, value: TensorOrTensors, device: torch.device) -> tuple[Any, int]:
    """Runs ``layer`` forward on ``value``; returns its output and the bytes the forward
    allocated and still holds: CUDA's allocator count, or elsewhere (no allocator to ask)
    the storages autograd saved for backward and the outputs, less the input's and the
    layer's own."""
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        output = layer(value)
        return output, torch.cuda.memory_allocated(device) - before
    with _Saved() as saved:
        output = layer(value)
    exclude = state_storages(layer) | {storage_key(t)[0] for t in _tensors(value, "input")}
    kept = storage_bytes([*saved.tensors, *_tensors(output, "a layer's output")], exclude)
    return output, kept


def layer_sizes(
    module: nn.Sequential,
    input: TensorOrTensors,
    chunks: int,
    param_scale: float,
    device: torch.device,
) -> list[float]:
    """Bytes each layer needs in training, as torchgpipe's ``balance_by_size`` counts them.

    A layer's activations are measured on one sample of ``input`` and scaled to a
    micro-batch (``batch / chunks`` samples); its parameters count ``param_scale`` times
    (the parameters, their gradients, the optimizer's state).

    Args:
        module: the model; not modified.
        input: a mini-batch as trained, batch along dim 0 (a tuple is one value).
        chunks: micro-batches per mini-batch.
        param_scale: copies of the parameters training holds.
        device: where the layers run. On CUDA the activations are what the allocator
            holds after the layer's forward; on other devices, the storages autograd saved
            for backward and the outputs.

    Returns:
        One size per layer, in bytes.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a layer's output is not a
            tensor or a tuple of tensors.
        ValueError: a parameter already has a gradient, ``chunks`` is not a positive
            integer or ``param_scale`` is negative.
    """
    _check(module)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if not param_scale >= 0:
        raise ValueError(f"param_scale must be non-negative, got {param_scale!r}")
    tensors = _tensors(input, "the input")
    scale = tensors[0].size(0) / chunks
    value: Any = _fresh(
        tuple(t[:1] for t in tensors) if isinstance(input, tuple) else tensors[0][:1], device
    )
    sizes = []
    with _unchanged_rng(device):
        for layer in layerwise_sandbox(module, device):
            value = _fresh(value, device)
            value, latent = _kept_bytes(layer, value, device)
            params = storage_bytes(list(layer.parameters()))
            sizes.append(latent * scale + params * param_scale)
    return sizes
