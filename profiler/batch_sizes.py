"""The micro-batch sizes layers are measured at, and the one rule that picks them.

``profile_layers``/``profile_model`` (and so ``autopipe plan``/``profile``), ``wrap()`` and
the configuration search all take their sizes from here, so they measure a model alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor, nn

__all__ = ["default_batch_sizes", "doubling_batch_sizes", "smallest_batch"]

# What BatchNorm raises in training when a channel has one value (batch 1, 1x1 map).
_ONE_VALUE = "Expected more than 1 value per channel when training"


def smallest_batch(layers: Iterable[nn.Module]) -> int:
    """The smallest micro-batch the layers are measured at: 2 where a BatchNorm trains.

    A BatchNorm in training normalizes each channel over the batch and the spatial
    positions; after a 1×1 feature map (a squeeze-excite block, the head of a ResNet) a
    batch of one leaves one value per channel, which it refuses. Whether a map is 1×1 is
    only known by running, so any training BatchNorm raises the floor.
    """
    for layer in layers:
        for module in layer.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
                return 2
    return 1


def default_batch_sizes(micro_batch: int, smallest: int = 1) -> list[int]:
    """Two distinct sizes, one of them the micro-batch, enough to fit a line through.

    The micro-batch and half of it; where the half would be below ``smallest``, the
    micro-batch and twice it (the plan interpolates, or extrapolates below ``smallest``).
    """
    micro = max(micro_batch, smallest)
    half = micro // 2
    if half >= smallest:
        return [half, micro]
    return [micro, 2 * micro]


def doubling_batch_sizes(batch: int, smallest: int = 1) -> list[int]:
    """Micro-batch sizes from ``smallest`` to the whole batch, doubling: every size a
    search over the micro-batch count may plan for lies between two of them."""
    sizes, size = [], min(smallest, batch)
    while size < batch:
        sizes.append(size)
        size *= 2
    return [*sizes, batch]


def batch_refusal(exc: BaseException, label: str, inputs: Sequence[Tensor]) -> str | None:
    """The one-line message for a layer that refused a micro-batch size, or ``None`` when
    ``exc`` is not such a refusal.

    Args:
        exc: what the layer raised.
        label: the layer, as messages name it (``layer 3 (BatchNorm2d)``).
        inputs: what it was called with; the first tensor with a dim 0 gives the size.
    """
    text = " ".join(str(exc).split())
    if _ONE_VALUE not in text:
        return None
    size = next((int(x.shape[0]) for x in inputs if isinstance(x, Tensor) and x.dim()), "?")
    return (
        f"{label} refuses a micro-batch of {size}: {text[:200]}. A BatchNorm in training "
        "needs more than one value per channel, which a batch of one after a 1x1 feature "
        "map does not give: use micro-batches of at least 2 samples (fewer chunks, a "
        "larger batch, batch sizes from 2)"
    )
