"""A zoo of CPU-sized benchmark models, one module each.

Every module defines ``model()`` (the ``nn.Module``, seeded random weights) and
``sample()`` (its mini-batch: a tensor or a tuple of tensors). They are small enough
that profiling a whole model takes seconds on a laptop CPU, while keeping the shape of
the real architectures that pipeline planners are usually evaluated on.
"""

from __future__ import annotations

from types import ModuleType

from benchmarks.models import amoebanet, bert, gpt2, resnet, unet

ZOO: dict[str, ModuleType] = {
    "resnet": resnet,
    "amoebanet": amoebanet,
    "unet": unet,
    "gpt2": gpt2,
    "bert": bert,
}

__all__ = ["ZOO", "amoebanet", "bert", "gpt2", "resnet", "unet"]
