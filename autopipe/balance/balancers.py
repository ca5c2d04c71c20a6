"""``balance_by_time`` and ``balance_by_size``: torchgpipe's calls, autopipe's optimal split."""

from __future__ import annotations

import torch
from torch import nn

from autopipe.balance import layer_measures
from autopipe.balance.layer_measures import TensorOrTensors
from autopipe.planning import partition
from profiler import default_device, resolve_device, storage_bytes

__all__ = ["balance_by_size", "balance_by_time"]

Device = torch.device | str | int


def _device(device: Device | None) -> torch.device:
    if device is None:
        return default_device()
    return torch.device("cuda", device) if isinstance(device, int) else resolve_device(device)


def _split(costs: list[float], partitions: int, module: nn.Sequential, strategy: str) -> list[int]:
    # Parameter bytes go along so that strategy="parameters" can balance them; the other
    # strategies split the costs alone (no capacity is given).
    params = [float(storage_bytes(list(layer.parameters()))) for layer in module]
    return partition(costs, partitions, memory=params, strategy=strategy)


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: TensorOrTensors,
    *,
    timeout: float = 1.0,
    device: Device | None = None,
    strategy: str = "optimal",
) -> list[int]:
    """A balance for ``GPipe`` from each layer's measured forward and backward time.

    torchgpipe's ``balance_by_time``: each layer runs as a copy on ``device`` (the model is
    left as it was), forward and backward, in passes repeated until ``timeout`` seconds
    are spent. The measured times are then split with the least largest partition time.

    Args:
        partitions: number of partitions.
        module: the ``nn.Sequential`` to split.
        sample: an input of the first layer, of any batch size.
        timeout: seconds after which no new pass starts (one pass at least).
        device: where the layers are measured; defaults to the current CUDA device, or
            the CPU without CUDA.
        strategy: ``optimal`` (exact), or ``blockpartition`` (torchgpipe's heuristic),
            ``uniform`` or ``parameters`` (see :func:`autopipe.partition`).

    Returns:
        Layers per partition, for ``GPipe(module, balance)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a layer returns something
            other than tensors.
        ValueError: a parameter already has a gradient, ``partitions`` is out of range, or
            the strategy is unknown.
    """
    times = layer_measures.layer_times(module, sample, timeout, _device(device))
    return _split(times, partitions, module, strategy)


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: TensorOrTensors,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: Device | None = None,
    strategy: str = "optimal",
) -> list[int]:
    """A balance for ``GPipe`` from each layer's measured training memory.

    torchgpipe's ``balance_by_size``: a layer's size is the memory its forward holds for
    a micro-batch of ``input`` (measured on one sample, scaled by ``batch / chunks``)
    plus ``param_scale`` times its parameter bytes. ``param_scale`` counts the copies of
    the parameters training holds: 2 for the parameters and their gradients, plus the
    optimizer's state (SGD with momentum 3, Adam 4). The sizes are then split with the
    least largest partition size.

    Args:
        partitions: number of partitions.
        module: the ``nn.Sequential`` to split.
        input: a mini-batch as trained, batch along dim 0.
        chunks: micro-batches per mini-batch, as given to ``GPipe``.
        param_scale: copies of the parameters training holds.
        device: where the layers are measured; defaults to the current CUDA device, or
            the CPU without CUDA. On CUDA the activations are the allocator's count; on
            the CPU, the bytes autograd saves for backward and the outputs.
        strategy: ``optimal`` (exact), or ``blockpartition``, ``uniform`` or
            ``parameters`` (see :func:`autopipe.partition`).

    Returns:
        Layers per partition, for ``GPipe(module, balance, chunks=chunks)``.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or a layer returns something
            other than tensors.
        ValueError: a parameter already has a gradient, an argument is out of range, or
            the strategy is unknown.
    """
    sizes = layer_measures.layer_sizes(module, input, chunks, param_scale, _device(device))
    return _split(sizes, partitions, module, strategy)
