"""Tests for the GPipe module: equivalence with sequential execution, API and lifecycle."""

from __future__ import annotations

import copy
import gc
import traceback
import warnings
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe import GPipe
from autopipe.gpipe.fill_drain import clock_cycles
from autopipe.microbatching.batchnorm import DeferredBatchNorm
from autopipe.planning.model.device_specs import DeviceSpec
from autopipe.planning.model.plans import Plan
from tests.support.gpipe_support import has_node, needs_cuda, worker_threads

MODES = ["always", "except_last", "never"]


def _model(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(8, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 3),
    ).double()


def _grads(module: nn.Module) -> list[Tensor]:
    grads = []
    for p in module.parameters():
        assert p.grad is not None
        grads.append(p.grad)
    return grads


def _assert_same(actual: list[Tensor], expected: list[Tensor], atol: float = 1e-6) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [8, 7, 2])
def test_matches_sequential_micro_batches(checkpoint: str, chunks: int, batch: int) -> None:
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 5, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        assert isinstance(out, Tensor)
        grad = torch.randn_like(out)
        out.backward(grad)
    expected = []
    count = min(chunks, batch)
    for part, g in zip(x_ref.tensor_split(count), grad.tensor_split(count)):
        y = reference(part)
        y.backward(g)
        expected.append(y.detach())
    _assert_same([out.detach()], [torch.cat(expected)])
    assert x.grad is not None and x_ref.grad is not None
    _assert_same([x.grad], [x_ref.grad])
    _assert_same(_grads(pipe), _grads(reference))


@pytest.mark.parametrize("checkpoint", MODES)
def test_bfloat16_autocast_matches_sequential_micro_batches(checkpoint: str) -> None:
    model = _model().float()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    with GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint) as pipe:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe(x)
        assert isinstance(out, Tensor) and out.dtype == torch.bfloat16
        grad = torch.randn_like(out)
        out.backward(grad)  # outside autocast, as recommended; recomputation re-enters it
    expected = []
    for part, g in zip(x_ref.tensor_split(3), grad.tensor_split(3)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = reference(part)
        y.backward(g)
        expected.append(y.detach())
    # The same micro-batches through the same kernels: bfloat16 rounding agrees too.
    _assert_same([out.detach()], [torch.cat(expected)], atol=1e-6)
    assert x.grad is not None and x_ref.grad is not None
    _assert_same([x.grad], [x_ref.grad], atol=1e-6)
    _assert_same(_grads(pipe), _grads(reference), atol=1e-6)


def test_float32_single_partition() -> None:
    model = _model().float()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 5)
    pipe = GPipe(model, [6], devices=["cpu"], chunks=3)
    pipe(x).sum().backward()
    sum(reference(part).sum() for part in x.tensor_split(3)).backward()
    _assert_same(_grads(pipe), _grads(reference))
    pipe.close()


def _run_dropout(checkpoint: str, seed: int) -> tuple[Tensor, list[Tensor], Tensor]:
    model = _model(dropout=0.5)
    x = torch.randn(10, 5, dtype=torch.float64)
    with GPipe(model, [3, 2, 1], devices=["cpu"] * 3, chunks=4, checkpoint=checkpoint) as pipe:
        torch.manual_seed(seed)
        out = pipe(x)
        out.square().sum().backward()
        after = torch.rand(2)
    return out.detach(), [g.clone() for g in _grads(pipe)], after


def test_dropout_checkpointed_equals_not_checkpointed() -> None:
    # Same masks give the same values up to rounding (no-grad and grad dropout kernels may
    # multiply in a different order); a different mask would differ by O(1).
    never = _run_dropout("never", 1)
    for mode in ("always", "except_last"):
        other = _run_dropout(mode, 1)
        _assert_same([other[0]], [never[0]], atol=1e-12)
        _assert_same(other[1], never[1], atol=1e-12)
        assert torch.equal(other[2], never[2])  # recomputation leaves the generator alone
    assert (_run_dropout("never", 2)[0] - never[0]).abs().max() > 1e-3


def test_dropout_matches_plain_model_in_clock_order() -> None:
    # Partitions sharing a device run in clock order; replaying that order by hand on the
    # plain layers draws the same random numbers.
    out, grads, _ = _run_dropout("always", 3)
    model = _model(dropout=0.5)
    x = torch.randn(10, 5, dtype=torch.float64)
    stages = [model[0:3], model[3:5], model[5:6]]
    values: dict[int, Tensor] = dict(enumerate(x.tensor_split(4)))
    torch.manual_seed(3)
    for clock in clock_cycles(4, 3):
        for i, j in clock:
            values[i] = stages[j](values[i])
    expected = torch.cat([values[i] for i in range(4)])
    expected.square().sum().backward()
    _assert_same([out], [expected.detach()], atol=1e-12)
    _assert_same(grads, _grads(model), atol=1e-12)


def test_checkpoint_modes_in_graph() -> None:
    x = torch.randn(4, 5, dtype=torch.float64)
    with GPipe(_model(), [3, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="always") as pipe:
        assert has_node(pipe(x), "CheckpointBackward")
        pipe.eval()
        assert not pipe.partitions[0].training
        out = pipe(x)
        assert out.requires_grad and not has_node(out, "CheckpointBackward")
        pipe.train()
        with torch.no_grad():
            out = pipe(x)
        assert not out.requires_grad and out.grad_fn is None


def test_checkpoint_keeps_only_partition_inputs() -> None:
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    x = torch.randn(4, 5, dtype=torch.float64)
    with GPipe(_model(), [3, 3], devices=["cpu", "cpu"], chunks=2, checkpoint="always") as pipe:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = pipe(x)
        out.sum().backward()
    # Two micro-batches on two partitions keep four tensors: each partition's inputs.
    inputs = [t for t in saved if t.shape[-1] == 5]
    boundaries = [t for t in saved if t.shape[-1] == 8]
    assert len(saved) == 4 and len(inputs) == 2 and len(boundaries) == 2


class _Split(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x.square()


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).double()

    def forward(self, pair: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        x, y, ids = pair
        return self.linear(x) + y, y * ids.unsqueeze(1), ids + 1


class _Take(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        return pair[0] * pair[1], pair[2]


@pytest.mark.parametrize("checkpoint", MODES)
def test_tuple_inputs_and_outputs(checkpoint: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Pair(), _Pair(), _Take())
    reference = copy.deepcopy(model)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 4, dtype=torch.float64)
    ids = torch.arange(5)
    with GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint) as pipe:
        out = pipe((x, y, ids))
    assert isinstance(out, tuple) and len(out) == 2
    assert torch.equal(out[1], ids + 2)
    out[0].sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    expected = reference((x_ref, y, ids))
    expected[0].sum().backward()
    _assert_same([out[0].detach()], [expected[0].detach()])
    assert x.grad is not None and x_ref.grad is not None
    _assert_same([x.grad], [x_ref.grad])
    _assert_same(_grads(pipe), _grads(reference))


def test_tensor_to_tuple_output() -> None:
    model = nn.Sequential(nn.Identity(), _Split())
    with GPipe(model, [1, 1], devices=["cpu", "cpu"], chunks=2) as pipe:
        out = pipe(torch.arange(4.0))
    assert isinstance(out, tuple) and torch.equal(out[1], torch.arange(4.0).square())


class _Join(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] * pair[1]


def test_sample_is_the_call_and_tuples_pass_as_one_value() -> None:
    """A sample holds the positional inputs, ``model(*sample)``, and between layers a tuple is
    one value: profiled, planned and run alike, equal to the plain model."""
    import autopipe
    from profiler import profile_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Split(), _Join(), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    sample = (torch.randn(6, 4, dtype=torch.float64),)
    profile = profile_model(model, sample, chunks=2, warmup=0, repeats=1)
    plan = autopipe.plan(profile, ["cpu", "cpu"], chunks=2, checkpoint="never")
    with GPipe.from_plan(model, plan) as pipe:
        out = pipe(*sample)
        out.sum().backward()
        expected = reference(*sample)
        expected.sum().backward()
        _assert_same([out.detach()], [expected.detach()])
        _assert_same(_grads(pipe), _grads(reference))
        with pytest.raises(TypeError, match="GPipe takes one input, as nn.Sequential does, not 2"):
            pipe(*sample, *sample)


def _bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 4),
        nn.BatchNorm1d(4, momentum=None),
    ).double()


def _deferred_cases() -> list[tuple[nn.Sequential, list[int], tuple[int, ...]]]:
    # Deferred statistics equal the full batch's only for layers whose input does not depend
    # on another batch-norm layer (which normalizes each micro-batch on its own).
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.BatchNorm2d(3), nn.Flatten())
    dense = nn.Sequential(
        nn.Linear(5, 6), nn.Tanh(), nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 2)
    )
    return [(conv.double(), [2, 2], (2, 4, 4)), (dense.double(), [2, 2], (5,))]


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("case", [0, 1])
def test_deferred_batch_norm_matches_full_batch(checkpoint: str, case: int) -> None:
    model, balance, shape = _deferred_cases()[case]
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    pipe = GPipe(
        model,
        balance,
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=checkpoint,
        deferred_batch_norm=True,
    )
    assert isinstance(pipe[2], DeferredBatchNorm) and list(pipe.state_dict()) == keys
    for step in range(2):
        x = torch.randn(10, *shape, dtype=torch.float64) * (step + 1)
        pipe(x).sum().backward()
        with torch.no_grad():
            reference(x)
    state, expected = pipe.state_dict(), reference.state_dict()
    assert int(state["2.num_batches_tracked"]) == 2
    for key in keys:
        torch.testing.assert_close(state[key], expected[key], rtol=0, atol=1e-9)
    pipe.close()


@pytest.mark.parametrize("checkpoint", MODES)
def test_plain_batch_norm_updates_once_per_micro_batch(checkpoint: str) -> None:
    model = _bn_model()
    reference = copy.deepcopy(model)
    x = torch.randn(10, 2, 4, 4, dtype=torch.float64)
    with GPipe(model, [3, 3], devices=["cpu", "cpu"], chunks=3, checkpoint=checkpoint) as pipe:
        pipe(x).sum().backward()
    with torch.no_grad():
        for part in x.tensor_split(3):
            reference(part)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, rtol=0, atol=1e-9)


class _Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and x.size(0) == 2:
            raise ValueError("boom in a partition")
        return x * 1


@pytest.mark.parametrize("checkpoint", MODES)
def test_exception_reaches_caller_and_pipeline_recovers(checkpoint: str) -> None:
    gc.collect()
    baseline = worker_threads()
    boom = _Boom()
    model = nn.Sequential(nn.Linear(5, 5).double(), boom, nn.Linear(5, 2).double())
    reference = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1, 1], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    x = torch.randn(7, 5, dtype=torch.float64)  # micro-batches of 3, 2, 2
    boom.armed = True
    with pytest.raises(ValueError, match="boom in a partition") as info:
        pipe(x)
    frames = traceback.extract_tb(info.value.__traceback__)
    assert frames[-1].name == "forward" and "raise ValueError" in (frames[-1].line or "")
    del info, frames
    boom.armed = False
    out = pipe(x)
    out.sum().backward()
    sum(reference(p).sum() for p in x.tensor_split(3)).backward()
    _assert_same(_grads(pipe), _grads(reference))
    pipe.close()
    assert worker_threads() == baseline


def test_workers_reused_and_stopped() -> None:
    gc.collect()
    baseline = worker_threads()
    pipe = GPipe(_model(), [2, 4], devices=["cpu", "cpu"], chunks=2)
    assert worker_threads() == baseline  # started lazily
    x = torch.randn(4, 5, dtype=torch.float64)
    pipe(x)
    threads = pipe._runtime().pool.threads()
    assert len(threads) == 1 and worker_threads() == baseline + 1
    for _ in range(3):
        pipe(x)
    assert pipe._runtime().pool.threads() == threads
    pipe.close()
    assert worker_threads() == baseline
    pipe(x)  # a closed GPipe starts new workers when used again
    assert worker_threads() == baseline + 1
    del pipe, threads
    gc.collect()
    assert worker_threads() == baseline


def test_copy_starts_its_own_workers() -> None:
    pipe = GPipe(_model(), [3, 3], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 5, dtype=torch.float64)
    out = pipe(x)
    clone = copy.deepcopy(pipe)
    torch.testing.assert_close(clone(x), out)
    assert clone._runtime().pool.threads() != pipe._runtime().pool.threads()
    clone.close()
    pipe.close()


def test_state_dict_round_trip() -> None:
    plain = _model()
    pipe = GPipe(copy.deepcopy(plain), [2, 4], devices=["cpu", "cpu"], chunks=2)
    assert list(pipe.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    fresh = _model()
    fresh.load_state_dict(pipe.state_dict())
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(fresh(x), pipe(x))
    other = GPipe(_model(), [3, 3], devices=["cpu", "cpu"], chunks=3)
    other.load_state_dict(plain.state_dict())
    torch.testing.assert_close(other(x), plain(x))
    pipe.close()
    other.close()


def test_named_layers_keep_names() -> None:
    model = nn.Sequential(OrderedDict(fc1=nn.Linear(2, 2), act=nn.ReLU(), fc2=nn.Linear(2, 1)))
    pipe = GPipe(model, [2, 1], devices=["cpu", "cpu"])
    assert list(pipe.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    with pytest.raises(ValueError, match="clashes"):
        GPipe(nn.Sequential(OrderedDict(chunks=nn.ReLU())), [1], devices=["cpu"])


def test_attributes() -> None:
    model = _model()
    layers = list(model)
    pipe = GPipe(
        model,
        [1, 2, 3],
        devices=["cpu", torch.device("cpu"), "cpu", "cpu"],
        chunks=5,
        checkpoint="never",
    )
    assert pipe.balance == [1, 2, 3] and pipe.chunks == 5 and pipe.checkpoint == "never"
    assert pipe.devices == [torch.device("cpu")] * 3
    assert isinstance(pipe.partitions, nn.ModuleList) and len(pipe.partitions) == 3
    assert all(isinstance(p, nn.Sequential) for p in pipe.partitions)
    assert [len(list(p.children())) for p in pipe.partitions] == [1, 2, 3]
    assert list(pipe) == layers and len(pipe) == 6 and pipe[4] is layers[4]
    assert "partitions" not in dict(pipe.named_children())


@pytest.mark.skipif(torch.cuda.is_available(), reason="default devices are GPUs here")
def test_default_devices_without_gpu() -> None:
    assert GPipe(_model(), [3, 3]).devices == [torch.device("cpu")] * 2


def test_moving_denied_but_dtype_allowed() -> None:
    pipe = GPipe(_model(), [3, 3], devices=["cpu", "cpu"])
    for move in (
        lambda: pipe.to("cpu"),
        lambda: pipe.cpu(),
        lambda: pipe.cuda(),
        lambda: pipe.to(device="cpu"),
    ):
        with pytest.raises(TypeError, match="cannot be moved"):
            move()
    pipe.to(torch.float32)
    assert pipe[0].weight.dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"module": nn.Linear(1, 1)}, TypeError, "nn.Sequential"),
        ({"balance": [3, 2]}, ValueError, "sums to 5"),
        ({"balance": [6, 0]}, ValueError, "at least one layer"),
        ({"balance": []}, ValueError, "at least one partition"),
        ({"balance": [3.0, 3]}, ValueError, "integers"),
        ({"devices": ["cpu"]}, ValueError, "need 2 devices"),
        ({"chunks": 0}, ValueError, "chunks"),
        ({"checkpoint": "sometimes"}, ValueError, "checkpoint is not one of"),
    ],
)
def test_validation(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args: dict[str, Any] = {"module": _model(), "balance": [3, 3], "devices": ["cpu", "cpu"]}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        GPipe(args.pop("module"), args.pop("balance"), **args)


def test_duplicate_layers_rejected() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="more than once"):
        GPipe(nn.Sequential(layer, layer), [1, 1], devices=["cpu", "cpu"])


def _plan(schedule: str = "gpipe") -> Plan:
    return Plan(
        balance=[4, 2],
        stages=[],
        chunks=3,
        micro_batch=2,
        checkpoint="never",
        schedule=schedule,
        strategy="manual",
        optimizer="sgd",
        bottleneck=0.0,
        bottleneck_stage=0,
        step_time=0.0,
        bubble=0.0,
        devices=[DeviceSpec("cpu"), DeviceSpec("cpu")],
    )


def test_from_plan() -> None:
    shared = _plan()
    shared.shared = [[0, 1]]  # as a plan made with colocated=True records the one CPU
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe = GPipe.from_plan(_model(), shared, deferred_batch_norm=True)
    assert pipe.balance == [4, 2] and pipe.chunks == 3 and pipe.checkpoint == "never"
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe.shared_devices == [[0, 1]]
    with pytest.warns(UserWarning, match="1f1b"):
        GPipe.from_plan(_model(), _plan("1f1b"))
    interleaved = _plan()
    interleaved.balance, interleaved.virtual_stages = [2, 2, 1, 1], 2
    interleaved.devices = interleaved.devices * 2
    with pytest.warns(UserWarning, match="interleaves 2 stages per device"):
        pipe = GPipe.from_plan(_model(), interleaved)
    assert pipe.balance == [2, 2, 1, 1]


@needs_cuda
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0", "cuda:0"], ["cpu", "cuda:0", "cuda:0"]])
def test_cuda_matches_sequential(checkpoint: str, devices: list[str]) -> None:
    model = _model()
    reference = copy.deepcopy(model).cuda()
    x = torch.randn(9, 5, dtype=torch.float64)
    with GPipe(model, [2, 2, 2], devices=devices, chunks=4, checkpoint=checkpoint) as pipe:
        out = pipe(x)
        assert out.device == torch.device("cuda", 0)
        out.square().sum().backward()
    expected = torch.cat([reference(p) for p in x.cuda().tensor_split(4)])
    expected.square().sum().backward()
    _assert_same([out.detach()], [expected.detach()])
    _assert_same([g.cuda() for g in _grads(pipe)], _grads(reference))


@needs_cuda
def test_cuda_dropout_checkpointed_equals_not_checkpointed() -> None:
    results = []
    for mode in ("never", "always"):
        model = _model(dropout=0.5)
        with GPipe(model, [3, 2, 1], devices=["cuda:0"] * 3, chunks=4, checkpoint=mode) as pipe:
            torch.manual_seed(5)
            out = pipe(torch.randn(10, 5, dtype=torch.float64))
            out.square().sum().backward()
        results.append((out.detach(), [g.clone() for g in _grads(pipe)]))
    assert torch.equal(results[0][0], results[1][0])
    _assert_same(results[0][1], results[1][1], atol=1e-12)


@needs_cuda
def test_cuda_exception_and_recovery() -> None:
    boom = _Boom()
    model = nn.Sequential(nn.Linear(5, 5).double(), boom, nn.Linear(5, 2).double())
    with GPipe(model, [1, 1, 1], devices=["cuda:0", "cuda:0", "cpu"], chunks=3) as pipe:
        boom.armed = True
        with pytest.raises(ValueError, match="boom"):
            pipe(torch.randn(7, 5, dtype=torch.float64))
        boom.armed = False
        assert pipe(torch.randn(7, 5, dtype=torch.float64)).shape == (7, 2)


def test_per_partition_checkpoint_modes_match_sequential() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    x = torch.randn(7, 5, dtype=torch.float64)
    modes = ["always", "never", "except_last"]
    with GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=3, checkpoint=modes) as pipe:
        assert pipe.checkpoint == modes
        out = pipe(x)
        out.square().sum().backward()
    expected = torch.cat([reference(p) for p in x.tensor_split(3)])
    expected.square().sum().backward()
    _assert_same([out.detach()], [expected.detach()])
    _assert_same(_grads(pipe), _grads(reference))
    with pytest.raises(ValueError, match="2 modes but there are 3 partitions"):
        GPipe(_model(), [2, 2, 2], devices=["cpu"] * 3, checkpoint=["never", "always"])


def test_from_auto_plan_uses_each_stage_mode() -> None:
    from autopipe.planning.model.plans import StagePlan

    plan = _plan()
    plan.checkpoint = "auto"

    def stage(index: int, mode: str) -> StagePlan:
        return StagePlan(
            index=index,
            device="cpu",
            start=0,
            stop=1,
            layers=[],
            compute=0.0,
            transfer=0.0,
            time=0.0,
            memory=0.0,
            param_memory=0.0,
            activation_memory=0.0,
            capacity=None,
            in_flight=3,
            checkpoint=mode,
        )

    plan.stages = [stage(0, "except_last"), stage(1, "never")]
    pipe = GPipe.from_plan(_model(), plan)
    assert pipe.checkpoint == ["except_last", "never"]
