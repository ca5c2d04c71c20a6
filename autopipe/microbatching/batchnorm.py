"""Deferred batch normalization: running statistics from the whole mini-batch, not per micro-batch.

Each micro-batch is still normalized with its own statistics (that is what a split batch
sees), but instead of moving the running statistics once per micro-batch, the layer merges
the micro-batch statistics exactly and moves the running statistics once per mini-batch, as
the unsplit layer would.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from autopipe.microbatching.recomputation import is_recomputing

__all__ = ["DeferredBatchNorm", "resolve_deferred"]


class DeferredBatchNorm(_BatchNorm):
    """A batch-norm layer that updates its running statistics once per mini-batch.

    It has the parameters and buffers of the layer it replaces, under the same names, so
    state dicts are interchangeable with the original model. :meth:`commit` applies the
    statistics gathered since the last commit; :class:`~autopipe.GPipe` calls it after
    every training forward.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self._reset_pending()

    def _reset_pending(self) -> None:
        # Plain attributes, not buffers: they must not show up in state dicts.
        self._count = 0
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if not is_recomputing():
            self._track(input)
        # Normalize with the micro-batch statistics and leave the running ones alone.
        return F.batch_norm(input, None, None, self.weight, self.bias, training=True, eps=self.eps)

    @torch.no_grad()
    def _track(self, input: Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        count = input.numel() // input.size(1)
        var, mean_ = torch.var_mean(input.detach(), dims, correction=0)
        # Per-channel vectors only are promoted, so merging adds no rounding worth noting.
        mean = mean_.to(torch.float64)
        m2 = var.to(torch.float64) * count
        if self._mean is None or self._m2 is None:
            self._count, self._mean, self._m2 = count, mean, m2
            return
        # Chan et al.'s pairwise merge: exact, and stable where sum-of-squares is not.
        total = self._count + count
        delta = mean - self._mean
        self._mean = self._mean + delta * (count / total)
        self._m2 = self._m2 + m2 + delta**2 * (self._count * count / total)
        self._count = total

    @torch.no_grad()
    def commit(self) -> None:
        """Moves the running statistics by the statistics gathered since the last commit."""
        if self._mean is None or self._m2 is None or self._count == 0:
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            factor = 1.0 / float(self.num_batches_tracked.item())
        else:
            factor = self.momentum
        unbiased = self._m2 / max(self._count - 1, 1)
        mean = self._mean.to(self.running_mean.dtype)
        var = unbiased.to(self.running_var.dtype)
        self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        self._reset_pending()

    def pending(self) -> tuple[int, Tensor | None, Tensor | None]:
        """The statistics gathered since the last commit: count, mean and sum of squared
        deviations per channel (float64; ``None`` before the first input)."""
        return self._count, self._mean, self._m2

    def set_pending(self, count: int, mean: Tensor | None, m2: Tensor | None) -> None:
        """Replaces the gathered statistics (with those merged over replicas, say)."""
        self._count, self._mean, self._m2 = count, mean, m2

    @classmethod
    def view(cls, module: _BatchNorm) -> DeferredBatchNorm:
        """A deferred layer over ``module``'s own parameters and buffers.

        It shares ``module``'s parameter and buffer dictionaries, not only their tensors:
        moving either module (``.to(device)`` replaces buffers) moves both, and the state
        dict keys are the same. ``module`` itself is left as it is.
        """
        deferred = cls(
            module.num_features,
            eps=module.eps,
            momentum=module.momentum,
            affine=module.affine,
            track_running_stats=True,
            device=module.running_mean.device if module.running_mean is not None else None,
            dtype=module.running_mean.dtype if module.running_mean is not None else None,
        )
        deferred.__dict__["_parameters"] = module._parameters
        deferred.__dict__["_buffers"] = module._buffers
        deferred.__dict__["_non_persistent_buffers_set"] = module._non_persistent_buffers_set
        deferred.train(module.training)
        return deferred

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Replaces every batch-norm layer in ``module`` (in place) with a deferred one.

        The new layers share the original parameters and buffers (see :meth:`view`).
        Returns ``module``, or the replacement if ``module`` itself is a batch-norm layer.
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            return cls.view(module) if module.track_running_stats else module
        for name, child in module.named_children():
            replacement = cls.convert(child)
            if replacement is not child:
                setattr(module, name, replacement)
        return module


def tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule is a batch-norm layer with running statistics."""
    return any(
        isinstance(m, _BatchNorm) and m.track_running_stats and not isinstance(m, DeferredBatchNorm)
        for m in module.modules()
    )


def deferred_copy(module: nn.Module, cache: dict[int, nn.Module] | None = None) -> nn.Module:
    """``module`` with its batch-norm layers deferred, leaving ``module`` itself unchanged.

    A batch-norm layer becomes its :meth:`DeferredBatchNorm.view`; a module holding one
    becomes a shallow copy whose children are converted likewise, sharing the original's
    parameters, buffers and hooks; any other module is returned as is. ``cache`` (by
    ``id`` of the original) makes a module used twice map to one copy.
    """
    cache = {} if cache is None else cache
    found = cache.get(id(module))
    if found is not None:
        return found
    if not tracks_statistics(module):
        return module
    copied: nn.Module
    if isinstance(module, _BatchNorm):
        copied = DeferredBatchNorm.view(module)
    else:
        copied = copy.copy(module)  # a new __dict__ whose values are the original's
        copied.__dict__["_modules"] = {
            name: None if child is None else deferred_copy(child, cache)
            for name, child in module._modules.items()
        }
    cache[id(module)] = copied
    return copied


def resolve_deferred(
    deferred: bool | None, model: nn.Module, chunks: int, replicas: int = 1
) -> tuple[bool, str | None]:
    """Whether to defer the model's batch-norm statistics, and a warning to give, if any.

    Args:
        deferred: the ``deferred_batch_norm`` argument; ``None`` means on when the model
            has a batch-norm layer with running statistics and a step splits the batch
            (into micro-batches or over replicas).
        model: the model.
        chunks: micro-batches per step (per replica).
        replicas: data-parallel replicas.

    Raises:
        ValueError: ``deferred`` is not ``None``, ``True`` or ``False``.
    """
    if deferred is not None and not isinstance(deferred, bool):
        raise ValueError(f"deferred_batch_norm must be True, False or None, got {deferred!r}")
    split = chunks > 1 or replicas > 1
    norms = tracks_statistics(model)
    if deferred is None:
        return norms and split, None
    if deferred or not (norms and split):
        return deferred, None
    averaged = f", then averaged over the {replicas} replicas" if replicas > 1 else ""
    return False, (
        f"deferred_batch_norm=False: BatchNorm running statistics advance once per "
        f"micro-batch ({chunks} updates per step, num_batches_tracked included{averaged}) "
        "instead of once from the whole mini-batch as in the plain model; leave "
        "deferred_batch_norm unset for one update per step"
    )
