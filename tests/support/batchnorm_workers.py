"""Rank workers of BatchNorm in a pipeline: deferred statistics on each schedule, and a
BatchNorm CNN trained with momentum."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.support.dist_models import (
    BATCH,
    CHUNKS,
    REPLICA_CHUNKS,
    loss_fn,
    make_batch,
    make_model,
    train_twice,
)


def batch_norms(model: nn.Module) -> list[nn.Module]:
    """The model's BatchNorm layers, of any dimension."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


class BatchNormCNN(nn.Module):
    """Conv-BatchNorm-ReLU blocks with a residual, and a BatchNorm1d head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.block = nn.Sequential(
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 6, 3, padding=1),
            nn.BatchNorm2d(6, momentum=None),  # a cumulative average
        )
        self.head = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))

    def forward(self, x: Tensor) -> Tensor:
        y = self.stem(x)
        y = torch.relu(y + self.block(y))
        return self.head(y.mean((2, 3)))


def make_bn_cnn() -> BatchNormCNN:
    torch.manual_seed(0)
    return BatchNormCNN()


def image_batches(steps: int = 3) -> list[tuple[Tensor, Tensor]]:
    """One mini-batch of BATCH 3×6×6 images and targets per step, each of another scale."""
    generator = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(BATCH, 3, 6, 6, generator=generator) * (1 + step) + step,
            torch.randn(BATCH, 3, generator=generator),
        )
        for step in range(steps)
    ]


def batchnorm(world: int) -> dict[str, Any]:
    """Deferred BatchNorm statistics on each schedule, re-computed, turned off, and with
    D=2 replicas (on 4 ranks: momentum=None, re-computed, the global mini-batch)."""
    import warnings

    from autopipe.distributed import DistributedPipeline

    x, y = make_batch()
    results: dict[str, Any] = {}
    if world == 4:
        model = make_model()
        model[3].momentum = None
        pipe = DistributedPipeline(
            model,
            x,
            loss_fn=loss_fn,
            chunks=REPLICA_CHUNKS,
            schedule="1f1b",
            checkpoint="always",
            data_parallel=2,
        )
        pipe.step(x, y)
        pipe.step(x * 2 + 1, y)
        own = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
        results["replicas"] = {"state": pipe.gather_state_dict(), "own": own}
        return results
    runs = {"gpipe": ("gpipe", "never"), "1f1b": ("1f1b", "never")}
    runs["1f1b always"] = ("1f1b", "always")
    for key, (schedule, mode) in runs.items():
        pipe = DistributedPipeline(
            make_model(), x, loss_fn=loss_fn, chunks=CHUNKS, schedule=schedule, checkpoint=mode
        )
        result = train_twice(pipe, x, y)
        result["state"] = pipe.gather_state_dict()
        results[key] = result
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = DistributedPipeline(
            model, x, loss_fn=loss_fn, chunks=CHUNKS, deferred_batch_norm=False
        )
    pipe.step(x, y)
    results["per micro-batch"] = {
        "state": pipe.gather_state_dict(),
        "warnings": [str(w.message) for w in caught],
        "classes": [type(m).__name__ for m in model.modules()],
    }
    return results


def batchnorm_training() -> dict[str, Any]:
    """The BatchNorm CNN trained 3 SGD steps with momentum, in 4 micro-batches and in 1."""
    from autopipe.distributed import DistributedPipeline

    batches = image_batches()
    results: dict[str, Any] = {}
    for chunks, schedule in ((CHUNKS, "1f1b"), (1, "gpipe")):
        pipe = DistributedPipeline(
            make_bn_cnn(), batches[0][0], loss_fn=loss_fn, chunks=chunks, schedule=schedule
        )
        optimizer = torch.optim.SGD(pipe.module.parameters(), lr=0.05, momentum=0.9)
        for x, y in batches:
            pipe.step(x, y)
            optimizer.step()
            optimizer.zero_grad()
        results[f"chunks={chunks}"] = pipe.gather_state_dict()
    return results
