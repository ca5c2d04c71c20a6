"""Tests for deferred batch normalization."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopipe import wrap
from autopipe.distributed.stage import StageModule
from autopipe.microbatching.batchnorm import DeferredBatchNorm, deferred_copy
from autopipe.microbatching.batchnorm_units import defer_layers
from autopipe.microbatching.recomputation import recomputing
from tests.support.batchnorm_workers import batch_norms, image_batches, make_bn_cnn
from tests.support.dist_models import (
    CHUNKS,
    REPLICA_CHUNKS,
    loss_fn,
    make_batch,
    make_model,
    reference_step,
    whole_batch_statistics,
)
from tests.support.dist_workers import launch


def _pair(momentum: float | None, dims: int) -> tuple[nn.Module, DeferredBatchNorm]:
    torch.manual_seed(0)
    kind = nn.BatchNorm1d if dims == 2 else nn.BatchNorm2d
    plain = kind(3, momentum=momentum).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-1, 1)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain))
    assert isinstance(deferred, DeferredBatchNorm)
    return plain, deferred


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("dims", [2, 4])
def test_statistics_match_full_batch(momentum: float | None, dims: int) -> None:
    plain, deferred = _pair(momentum, dims)
    for step in range(2):
        shape = (11, 3) if dims == 2 else (11, 3, 4, 5)
        x = torch.randn(*shape, dtype=torch.float64) * (step + 1) + step
        plain(x)
        outputs = [deferred(part) for part in x.tensor_split(4)]
        deferred.commit()
        # Each micro-batch is normalized with its own statistics.
        for part, out in zip(x.tensor_split(4), outputs):
            expected = nn.functional.batch_norm(
                part, None, None, deferred.weight, deferred.bias, training=True
            )
            torch.testing.assert_close(out, expected)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(deferred, name), getattr(plain, name), rtol=0, atol=1e-9)


def test_state_dict_keys_and_sharing() -> None:
    plain, deferred = _pair(0.1, 2)
    assert list(deferred.state_dict()) == list(plain.state_dict())
    bn = nn.BatchNorm1d(3)
    inner = nn.Sequential(bn)
    model = nn.Sequential(nn.Linear(2, 3), inner)
    converted = DeferredBatchNorm.convert(model)
    replaced = inner[0]
    assert converted is model and isinstance(replaced, DeferredBatchNorm)
    assert replaced.weight is bn.weight and replaced.running_mean is bn.running_mean


def test_no_tracking_in_eval_or_recompute_and_untracked_kept() -> None:
    _, deferred = _pair(0.1, 2)
    before = deferred.running_mean.clone()  # type: ignore[union-attr]
    with recomputing():
        deferred(torch.randn(4, 3, dtype=torch.float64))
    deferred.commit()
    deferred.eval()
    deferred(torch.randn(4, 3, dtype=torch.float64))
    deferred.commit()
    assert torch.equal(deferred.running_mean, before)  # type: ignore[arg-type]
    assert int(deferred.num_batches_tracked) == 0  # type: ignore[arg-type]
    untracked = nn.BatchNorm1d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert(untracked) is untracked


def test_rejects_1d_input() -> None:
    _, deferred = _pair(0.1, 2)
    with pytest.raises(ValueError, match="2D"):
        deferred(torch.randn(3))


def test_view_shares_state_through_moves() -> None:
    plain = nn.BatchNorm1d(3)
    view = DeferredBatchNorm.view(plain)
    view.double()  # replaces the buffers: the plain layer sees the new ones
    assert plain.running_mean.dtype == torch.float64  # type: ignore[union-attr]
    assert view.running_mean is plain.running_mean and view.weight is plain.weight
    assert list(view.state_dict()) == list(plain.state_dict())


def test_deferred_copy_leaves_the_original() -> None:
    inner = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model = nn.Sequential(inner, nn.ReLU(), nn.BatchNorm1d(3, track_running_stats=False))
    copied = deferred_copy(model)
    assert isinstance(copied[0][1], DeferredBatchNorm) and copied[1] is model[1]
    assert copied[2] is model[2]  # nothing to defer without running statistics
    assert type(inner[1]) is nn.BatchNorm1d and model[0] is inner
    assert list(copied.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(copied.parameters(), model.parameters()))
    assert deferred_copy(nn.Linear(2, 2)) is not None


# ---------------------------------------------------------------- wrap()


def _cnn(method: str) -> nn.Module:
    model = make_bn_cnn()
    if method == "export":  # torch.export cannot trace momentum=None (data-dependent)
        model.block[4].momentum = 0.1  # type: ignore[index]
    return model


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_wrap_updates_statistics_once_per_step(method: str, checkpoint: str) -> None:
    model, reference = _cnn(method), _cnn(method)
    whole = copy.deepcopy(reference)
    batches = image_batches(2)
    wrapped = wrap(model, batches[0][0], stages=2, chunks=4, checkpoint=checkpoint, method=method)
    try:
        for step, (x, y) in enumerate(batches):
            output = wrapped(x)
            loss_fn(output, y).backward()
            expected = reference_step(reference, x, y, chunks=4)
            torch.testing.assert_close(loss_fn(output, y).detach(), expected)
            if step == 0:  # the first layer's statistics: the plain model's on the whole batch
                whole.train()(x)
                first = wrapped.state_dict()
                for key in ("running_mean", "running_var", "num_batches_tracked"):
                    value = whole.state_dict()[f"stem.1.{key}"]
                    torch.testing.assert_close(first[f"stem.1.{key}"], value)
    finally:
        wrapped.close()
    state = wrapped.state_dict()
    assert list(state) == list(reference.state_dict())
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, param.grad, msg=name)
    assert all(int(m.num_batches_tracked) == 2 for m in batch_norms(model))  # type: ignore[arg-type]
    # The model keeps its own classes; the pipeline runs views of its layers.
    assert all(type(m) is not DeferredBatchNorm for m in model.modules())


def test_wrap_with_deferral_off_warns_and_counts_micro_batches() -> None:
    model = make_bn_cnn()
    x, y = image_batches(1)[0]
    with pytest.warns(UserWarning, match="once per micro-batch .4 updates per step"):
        wrapped = wrap(model, x, stages=2, chunks=4, deferred_batch_norm=False)
    loss_fn(wrapped(x), y).backward()
    wrapped.close()
    assert all(int(m.num_batches_tracked) == 4 for m in batch_norms(model))  # type: ignore[arg-type]


def test_wrap_in_one_micro_batch_is_the_plain_model() -> None:
    model, reference = make_bn_cnn(), make_bn_cnn()
    x, y = image_batches(1)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        wrapped = wrap(model, x, stages=2, chunks=1)
    output = wrapped(x)
    loss_fn(output, y).backward()
    wrapped.close()
    expected = reference(x)
    loss_fn(expected, y).backward()
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for name, param in reference.named_parameters():
        grad = model.get_parameter(name).grad
        torch.testing.assert_close(grad, param.grad, rtol=0, atol=0, msg=name)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(self.bn(x)))


class _Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn  # its state, with another momentum than its own
        y = nn.functional.batch_norm(
            self.fc(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, self.training, 0.5
        )
        return self.head(y)


@pytest.mark.parametrize("method", ["fx", "export"])
def test_wrap_refuses_functional_batch_norm(method: str) -> None:
    with pytest.raises(ValueError, match="running statistics cannot be deferred"):
        wrap(_Functional(), torch.randn(8, 4), stages=2, chunks=2, method=method)


def test_wrap_refuses_what_it_cannot_defer() -> None:
    x = torch.randn(8, 4)
    model = _Twice()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="BatchNorm 'bn' runs 2 times per forward"):
        wrap(model, x, stages=2, chunks=2)
    with pytest.raises(ValueError, match="deferred_batch_norm must be True, False or None"):
        wrap(_Twice(), x, stages=2, chunks=2, deferred_batch_norm="yes")  # type: ignore[arg-type]
    # A refused model is left as it was: its own layers, its state.
    assert type(model.bn) is nn.BatchNorm1d and list(model.bn._modules) == []
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


# ---------------------------------------------------------------- distributed stages


def test_recomputed_stage_counts_each_micro_batch_once() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    reference = copy.deepcopy(plain)
    layers = defer_layers(OrderedDict(plain.named_children()), plain)
    stage = StageModule(list(layers.items()), checkpoint="always", chunks=4)
    x = torch.randn(16, 4)
    with whole_batch_statistics(reference):
        for part in x.chunk(4):
            reference(part).sum().backward()
    for part in x.chunk(4):
        stage(part).sum().backward()  # each re-computed in its backward
    norm = stage.get_submodule("1")
    assert isinstance(norm, DeferredBatchNorm) and stage.checkpointed == 4
    norm.commit()
    for key, value in reference[1].state_dict().items():
        torch.testing.assert_close(norm.state_dict()[key], value, msg=key)


def _ranks(scenario: str, world: int, workdir: Path) -> list[Any]:
    runs = launch(scenario, world, workdir, limit=150)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"rank {rank} failed:\n{run.output[-3000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    return _ranks("batchnorm", 2, tmp_path_factory.mktemp("batchnorm2"))


def _close_states(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("key", ["gpipe", "1f1b", "1f1b always"])
def test_distributed_updates_statistics_once_per_step(two_ranks: list[Any], key: str) -> None:
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y)
    reference_step(model, x, y)
    run = two_ranks[0][key]
    torch.testing.assert_close(two_ranks[-1][key]["loss"], loss, rtol=1e-5, atol=1e-6)
    _close_states(run["state"], model.state_dict())
    assert int(run["state"]["3.num_batches_tracked"]) == 2


def test_distributed_with_deferral_off_warns_and_counts_micro_batches(
    two_ranks: list[Any],
) -> None:
    for rank in two_ranks:
        run = rank["per micro-batch"]
        assert any("once per micro-batch (4 updates per step" in w for w in run["warnings"])
        assert "BatchNorm1d" in run["classes"]  # the model keeps its own layers
    assert int(two_ranks[0]["per micro-batch"]["state"]["3.num_batches_tracked"]) == CHUNKS


def test_replicas_update_statistics_from_the_global_batch(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    ranks = _ranks("batchnorm", 4, tmp_path_factory.mktemp("batchnorm4"))
    model = make_model()
    model[3].momentum = None  # a cumulative average over the steps
    x, y = make_batch()
    for inputs in (x, x * 2 + 1):  # all D·M micro-batches of the global batch, in order
        reference_step(model, inputs, y, chunks=2 * REPLICA_CHUNKS)
    expected = model.state_dict()
    _close_states(ranks[0]["replicas"]["state"], expected)
    assert int(ranks[0]["replicas"]["state"]["3.num_batches_tracked"]) == 2
    for rank in ranks:  # every replica holds the same statistics
        own = rank["replicas"]["own"]
        _close_states(own, {k: expected[k] for k in own})
