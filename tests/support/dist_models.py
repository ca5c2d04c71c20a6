"""What the multi-rank tests and their workers share: the small model, its batch, its
loss, the single-process reference step, and the helpers that train and compare."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

CHUNKS = 4
BATCH = 16
# Micro-batches per replica with D=2: 4 rows each, as profiling BatchNorm needs 2 or more.
REPLICA_CHUNKS = 2
UNEVEN = 14  # rows of a batch that CHUNKS micro-batches split unevenly: 4, 4, 3, 3


def make_model(seed: int = 0, width: int = 16, batchnorm: bool = True) -> nn.Sequential:
    """A small model with a buffer-carrying layer, identical for equal seeds."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width) if batchnorm else nn.Identity(),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 3),
    )


def make_residual() -> nn.Module:
    """A non-Sequential model with skip connections, auto-wrapped into units."""
    from tests.support.wrap_models import ResidualMLP

    torch.manual_seed(0)
    return ResidualMLP()


def make_batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 3, generator=generator)


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


@contextlib.contextmanager
def whole_batch_statistics(model: nn.Module) -> Iterator[None]:
    """Runs the block with the model's BatchNorm running statistics updated once, at the
    end, from every input each layer saw in it: the plain layer's own update on them all.

    The block runs the model micro-batch by micro-batch (each normalized with its own
    statistics, as in a pipeline), and its backward (which checks that the statistics
    it saved are unchanged); the layers' per-call updates are undone, then each layer
    runs once on the concatenation of its inputs, without gradients.
    """
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
    seen: dict[int, list[Tensor]] = {id(m): [] for m in norms}
    saved = [{k: v.clone() for k, v in m._buffers.items() if v is not None} for m in norms]

    def record(module: nn.Module, args: tuple[Any, ...]) -> None:
        if module.training:
            seen[id(module)].append(args[0].detach())

    hooks = [m.register_forward_pre_hook(record) for m in norms]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for norm, state in zip(norms, saved):
            for key, value in state.items():
                norm.get_buffer(key).copy_(value)
            if seen[id(norm)]:
                norm(torch.cat(seen[id(norm)]))


def reference_step(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    chunks: int = CHUNKS,
    loss: Callable[[Any, Tensor], Tensor] = loss_fn,
) -> Tensor:
    """Single-process reference: the mean of per-micro-batch losses, back-propagated, and
    BatchNorm statistics updated once from the whole mini-batch."""
    pairs = zip(x.tensor_split(chunks), y.tensor_split(chunks))
    with whole_batch_statistics(model):
        value = torch.stack([loss(model(xb), yb) for xb, yb in pairs]).mean()
        value.backward()
    return value.detach()


def titan_position(rank: int, stages: int, replicas: int, tensor: int = 1) -> tuple[int, int, int]:
    """``(stage, replica, tensor rank)`` of ``rank`` in torchtitan's device mesh of
    ``pp, dp, tp`` (the ranks laid out as ``arange(K·D·t).view(K, D, t)``)."""
    grid = torch.arange(stages * replicas * tensor).view(stages, replicas, tensor)
    found = (grid == rank).nonzero()[0].tolist()
    return found[0], found[1], found[2]


def sgd_steps(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Callable[[Any, Tensor], Tensor],
    chunks: int,
    steps: int,
    lr: float,
) -> list[dict[str, Any]]:
    """The plain model's reference: ``steps`` SGD steps of :func:`reference_step` (the mean
    of the ``chunks`` micro-batches' losses, as a pipeline's step takes it), each step's
    loss and parameters after its update."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        value = reference_step(model, x, y, chunks, loss)
        opt.step()
        opt.zero_grad()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"loss": value, "params": params})
    return out


@functools.cache
def reference_steps() -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """Loss and gradients after one reference step, gradients and state after two."""
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reference_step(model, x, y)
    twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, once, twice, model.state_dict()


def assert_close(actual: Tensor, expected: Tensor, name: str = "") -> None:
    """Equal as one process computes it, up to the order of float additions."""
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def tiny_plan(data_parallel: int = 1, stages: int = 2) -> Any:
    """A plan of 8 equal layers in equal stages, made without a process group."""
    from autopipe.planning.planner import evaluate
    from tests.support.planning_cases import linear_profile

    profile = linear_profile([1.0] * 8)
    return evaluate(profile, [8 // stages] * stages, data_parallel=data_parallel)


def param_grads(pipe: Any) -> dict[str, Tensor]:
    """A copy of every gradient this rank holds, by parameter name."""
    return {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}


def train_twice(pipe: Any, x: Tensor, y: Tensor) -> dict[str, Any]:
    """Two steps without ``zero_grad``: the first loss, the gradients after each, the split."""
    first = pipe.step(x, y)
    grads = param_grads(pipe)
    pipe.step(x, y)  # no zero_grad: gradients must add up, not be rescaled
    twice = param_grads(pipe)
    return {"loss": first, "grads": grads, "twice": twice, "balance": pipe.plan.balance}


class TwoInputs(nn.Module):
    """Two positional inputs, both taken by its first layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Bilinear(8, 3, 16)
        self.act = nn.Tanh()
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.out(self.act(self.hidden(self.act(self.first(a, b)))))


class Concat(nn.Module):
    """Takes a tuple as its one argument, as nn.Sequential passes it."""

    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return torch.cat(pair, dim=1)


def make_concat() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Concat(), nn.Linear(11, 16), nn.Tanh(), nn.Linear(16, 3))
