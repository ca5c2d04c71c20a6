"""Re-computed forwards see the buffers their first run saw; written buffers are named."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx
from torch import nn

import autopipe
from autopipe.distributed.stage import StageModule
from autopipe.microbatching import BufferSnapshot, per_micro_batch_writes


class Counted(nn.Module):
    """Counts its calls in a buffer and scales by the count: a re-computation that finds
    the count its own first run moved computes something else."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.calls


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Counted(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_snapshot_runs_a_block_on_copies_of_the_values_taken() -> None:
    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("steps", torch.zeros(()))
            self.register_buffer("table", torch.ones(3))  # read only

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps.add_(1)
            return x * self.table * self.steps

    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    steps = Steps()
    unit = fx.GraphModule(steps, tracer.trace(steps))
    owner = nn.Sequential(unit, Counted())  # a traced unit and a module of any code
    snapshot = BufferSnapshot(owner)
    assert [name for _, name, _ in snapshot.values] == ["steps"]  # only what the graph writes
    assert [name for _, name in snapshot.others] == ["calls"]
    unit(torch.ones(2, 3))
    owner[1].calls += 1
    live, counted = unit.steps, owner[1].calls
    with snapshot.restored():
        assert unit.steps.item() == 0  # as taken, not as moved since
        assert owner[1].calls is counted  # left live (GPipe's rule)
        unit(torch.ones(2, 3))  # a copy's write
    assert unit.steps is live and live.item() == 1
    with snapshot.restored(copy_others=True):
        assert owner[1].calls is not counted and owner[1].calls.item() == 1
        owner[1].calls += 1
    assert owner[1].calls is counted and counted.item() == 1


def test_a_wrapped_model_re_computes_what_its_first_run_computed() -> None:
    model, x = _model(), torch.randn(4, 6, dtype=torch.float64)
    plain = copy.deepcopy(model)
    wrapped = autopipe.wrap(model, (x,), stages=2, chunks=1, checkpoint="always")
    plain(x).pow(2).sum().backward()
    wrapped(x).pow(2).sum().backward()
    assert all(map(torch.equal, _grads(model), _grads(plain)))
    assert model[0].calls.item() == plain[0].calls.item() == 1  # counted once


@pytest.mark.parametrize("units", ["traced", "children"])
def test_a_checkpointed_stage_re_computes_what_its_first_run_computed(units: str) -> None:
    model, x = _model(), torch.randn(4, 6, dtype=torch.float64)
    # DistributedPipeline's units: a traced model's, or an nn.Sequential's own children.
    layers = (
        list(enumerate(autopipe.wrap(model, (x,), stages=1, chunks=1).pipeline))
        if units == "traced"
        else list(model.named_children())
    )
    results = []
    for checkpoint in ("never", "always"):
        stage = StageModule(
            [(str(name), copy.deepcopy(layer)) for name, layer in layers],
            checkpoint=checkpoint,
            chunks=1,
        )
        out = stage(x)
        (out[0] if isinstance(out, tuple) else out).pow(2).sum().backward()
        calls = [b for name, b in stage.named_buffers() if name.endswith("calls")]
        results.append((_grads(stage), calls[0].item()))
    (plain, plain_calls), (again, calls) = results
    assert all(map(torch.equal, again, plain))
    assert calls == plain_calls == 1


def test_a_stage_takes_small_buffers_of_modules_it_cannot_read_and_leaves_tables() -> None:
    counted = Counted()
    counted.register_buffer("table", torch.zeros(512, 1024))  # 2 MiB: read, not copied
    snapshot = BufferSnapshot(counted, small=True)
    assert [name for _, name, _ in snapshot.values] == ["calls"]
    assert [name for _, name in snapshot.others] == ["table"]
    assert [name for _, name in BufferSnapshot(counted).others] == ["calls", "table"]


def test_buffers_written_per_micro_batch_are_named_and_warned() -> None:
    model, x = _model(), torch.randn(4, 6, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = autopipe.wrap(model, (x,), stages=2, chunks=2)
    assert per_micro_batch_writes(model, list(wrapped.pipeline)) == ["0.calls"]
    assert any("writes the buffers 0.calls in place" in str(w.message) for w in caught)
    # Batch norm's statistics are kept whole-batch (deferred): no warning for them.
    norm = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = autopipe.wrap(norm, (torch.randn(8, 6),), stages=2, chunks=2)
    assert per_micro_batch_writes(norm, list(wrapped.pipeline)) == []
    assert not any("writes the buffers" in str(w.message) for w in caught)
