"""Per-unit re-computation in GPipe (autopipe.gpipe.recomputed_units): partitions of mode
``units`` train exactly like the plain model and keep less for backward."""

from __future__ import annotations

import copy
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.gpipe import GPipe
from autopipe.gpipe.fill_drain import clock_cycles
from autopipe.gpipe.recomputed_units import RecomputedUnits, plan_recomputation
from autopipe.gpipe.split_bench import time_splits
from autopipe.gpipe.wrapping import wrap
from autopipe.microbatching import is_checkpointing, is_recomputing
from autopipe.microbatching.batchnorm import DeferredBatchNorm
from autopipe.planning import plan
from autopipe.planning.planner import evaluate
from profiler import profile_model
from profiler.profile import Profile
from tests.support.float64 import assert_close64, square_loss
from tests.support.gpipe_support import has_node, needs_cuda
from tests.support.planning_cases import linear_profile
from tests.support.wrap_models import ResidualMLP

pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype

STEPS = 3


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 8),
        nn.Tanh(),
        nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)),
        nn.ReLU(inplace=True),
        nn.Linear(8, 3),
    )


def _assert_same_state(pipe: nn.Module, reference: nn.Module) -> None:
    """Every parameter, its gradient and every buffer, under the plain model's names."""
    expected = dict(reference.named_parameters())
    for name, param in pipe.named_parameters():
        assert param.grad is not None and expected[name].grad is not None, name
        assert_close64(param.grad, expected[name].grad)
    state, plain = pipe.state_dict(), reference.state_dict()
    assert list(state) == list(plain)
    for key, value in plain.items():
        assert_close64(state[key], value)


def _assert_same_state_values(pipe: nn.Module, reference: nn.Module) -> None:
    state, plain = pipe.state_dict(), reference.state_dict()
    for key, value in plain.items():
        assert_close64(state[key], value)


@pytest.mark.parametrize(
    ("checkpoint", "recompute"),
    [
        # The first unit (its input needs no gradient), in-place ReLUs, a block of layers.
        (["units", "never", "units"], [[0, 1], [], [0, 1]]),
        ("units", [[2], [0], [1]]),
        (["always", "units", "except_last"], [[], [0, 1], []]),
    ],
)
def test_mlp_with_recomputed_units_trains_like_the_plain_model(
    checkpoint: str | list[str], recompute: list[list[int]]
) -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    pipe = GPipe(
        model,
        [3, 2, 2],
        devices=["cpu"] * 3,
        chunks=3,
        checkpoint=checkpoint,
        recompute=recompute,
    )
    assert pipe.recompute == recompute
    assert [isinstance(p, RecomputedUnits) for p in pipe.partitions] == [bool(r) for r in recompute]
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        torch.manual_seed(step)
        x = torch.randn(7, 5)
        out = pipe(x)
        assert has_node(out, "CheckpointBackward")
        expected = reference(x)
        assert_close64(out, expected)
        square_loss(out).backward()
        square_loss(expected).backward()
        _assert_same_state(pipe, reference)
        for opt in (optimizer, expected_optimizer):
            opt.step()
            opt.zero_grad()
    _assert_same_state_values(pipe, reference)
    pipe.close()


def _bn_dropout() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(inplace=True), nn.Dropout(0.5)
    )
    return nn.Sequential(
        block,
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, momentum=None),
        nn.Dropout(0.3),
        nn.Tanh(),
        nn.Linear(8, 3),
    )


# The block (its batch norm and dropout inside), the second batch norm and dropout.
BN_RECOMPUTE = [[0], [1, 2]]


def _replayed(model: nn.Sequential, x: Tensor, chunks: int) -> Tensor:
    """The plain layers run micro-batch by micro-batch in GPipe's clock order, which draws
    the same random numbers and moves the running statistics per micro-batch alike."""
    stages = [model[0:2], model[2:6]]
    values: dict[int, Tensor] = dict(enumerate(x.tensor_split(chunks)))
    for clock in clock_cycles(chunks, len(stages)):
        for i, j in clock:
            values[i] = stages[j](values[i])
    return torch.cat([values[i] for i in range(chunks)])


@pytest.mark.parametrize("chunks", [1, 3])
def test_batch_norm_and_dropout_units_train_like_the_plain_model(chunks: int) -> None:
    # One micro-batch is the plain model itself; three run the plain layers in clock order.
    model = _bn_dropout()
    reference = copy.deepcopy(model)
    pipe = GPipe(
        model,
        [2, 4],
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint="units",
        recompute=BN_RECOMPUTE,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(9, 5) * (step + 1)
        torch.manual_seed(10 + step)
        out = pipe(x)
        square_loss(out).backward()
        after = torch.rand(3)
        torch.manual_seed(10 + step)
        expected = _replayed(reference, x, chunks)
        square_loss(expected).backward()
        # Re-computation replays the dropout masks and then puts the generator back.
        assert torch.equal(after, torch.rand(3))
        assert_close64(out, expected)
        _assert_same_state(pipe, reference)
        for opt in (optimizer, expected_optimizer):
            opt.step()
            opt.zero_grad()
    # Running statistics moved once per micro-batch, not again when re-computed.
    assert int(pipe.state_dict()["2.num_batches_tracked"]) == STEPS * chunks
    _assert_same_state_values(pipe, reference)
    pipe.close()


def test_deferred_batch_norm_units_commit_once_per_step() -> None:
    # The same pipeline without re-computation is the reference: deferred statistics of
    # re-computed units are gathered from the first run only.
    results = []
    for recompute in (None, BN_RECOMPUTE):
        pipe = GPipe(
            _bn_dropout(),
            [2, 4],
            devices=["cpu", "cpu"],
            chunks=3,
            checkpoint="never" if recompute is None else "units",
            recompute=recompute,
            deferred_batch_norm=True,
        )
        assert isinstance(pipe[2], DeferredBatchNorm)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        outputs = []
        for step in range(STEPS):
            torch.manual_seed(10 + step)
            out = pipe(torch.randn(9, 5) * (step + 1))
            square_loss(out).backward()
            outputs.append(out.detach())
            optimizer.step()
            optimizer.zero_grad()
        assert int(pipe.state_dict()["2.num_batches_tracked"]) == STEPS
        results.append((outputs, pipe.state_dict()))
        pipe.close()
    (never_out, never_state), (units_out, units_state) = results
    assert_close64(units_out, never_out)
    assert list(units_state) == list(never_state)
    for key, value in never_state.items():
        assert_close64(units_state[key], value)


class _Spy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x.tanh()


def test_a_unit_is_checkpointed_then_recomputed_and_only_in_training() -> None:
    kept, plain = _Spy(), _Spy()
    model = nn.Sequential(nn.Linear(4, 4), kept, plain, nn.Linear(4, 2))
    pipe = GPipe(
        model, [3, 1], devices=["cpu", "cpu"], chunks=2, checkpoint="units", recompute=[[1], [0]]
    )
    pipe(torch.randn(4, 4)).sum().backward()
    # Every micro-batch: first run checkpointing, re-run in backward recomputing.
    assert kept.seen == [(True, False)] * 2 + [(False, True)] * 2
    assert plain.seen == [(False, False)] * 2
    kept.seen.clear()
    pipe.eval()
    out = pipe(torch.randn(4, 4))
    assert not has_node(out, "CheckpointBackward") and kept.seen == [(False, False)] * 2
    pipe.train()
    with torch.no_grad():
        pipe(torch.randn(4, 4))
    assert kept.seen == [(False, False)] * 4
    pipe.close()


def _block() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def test_a_tied_parameter_in_recomputed_units_gets_every_gradient() -> None:
    # The last partition reads a copy of the first layer's weight (replicate_shared), also
    # in the re-computation of its unit.
    torch.manual_seed(0)
    first, middle, last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), middle, last)
    reference = copy.deepcopy(model)
    pipe = GPipe(
        model,
        [2, 2],
        devices=["cpu", "cpu"],
        chunks=3,
        checkpoint="units",
        recompute=[[0], [1]],
        replicate_shared=True,
    )
    assert pipe.replicated == {"0.weight": (0, 1)}
    x = torch.randn(7, 4)
    out, expected = pipe(x), reference(x)
    assert_close64(out, expected)
    square_loss(out).backward()
    square_loss(expected).backward()
    _assert_same_state(pipe, reference)
    pipe.close()


def test_recomputed_units_keep_only_their_inputs() -> None:
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    x = torch.randn(4, 16)
    counts = {}
    for recompute in (None, [[0, 1]]):
        torch.manual_seed(0)
        pipe = GPipe(
            nn.Sequential(_block(), _block()),
            [2],
            devices=["cpu"],
            chunks=2,
            checkpoint="never" if recompute is None else "units",
            recompute=recompute,
        )
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = pipe(x)
        out.sum().backward()
        counts[recompute is None] = [tuple(t.shape) for t in saved if t.dim() == 2]
        pipe.close()
    # Two micro-batches through two re-computed blocks keep the blocks' inputs only.
    assert counts[False] == [(2, 16)] * 4
    assert any(shape == (2, 64) for shape in counts[True])


def test_the_bench_measures_less_saved_for_recomputed_units() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(*[_block() for _ in range(4)])
    sample = torch.randn(8, 16)
    profile = profile_model(layers, sample, device="cpu", chunks=2, repeats=1, warmup=0)
    never = evaluate(profile, [2, 2], 2, chunks=2, checkpoint="never", optimizer="sgd")
    units = copy.deepcopy(never)
    units.checkpoint = "auto"
    units.stages[0].checkpoint, units.stages[0].recompute_units = "units", [0, 1]
    units.stages[1].checkpoint = "never"
    assert plan_recomputation(units) == (["units", "never"], [[0, 1], []])
    result = time_splits(
        layers, sample, {"never": never, "units": units}, steps=1, warmup=0, devices=["cpu"] * 2
    )
    kept, recomputed = result["never"].saved_peak, result["units"].saved_peak
    assert all(isinstance(peak, int) and peak > 0 for peak in [*kept, *recomputed])
    assert recomputed[0] < kept[0]  # type: ignore[operator]
    assert recomputed[1] == kept[1]


def test_from_plan_runs_the_planned_units() -> None:
    profile = linear_profile(
        [1.0, 2.0, 3.0, 4.0, 1.0, 1.0],
        saved=[100] * 6,
        output=[10] * 6,
        batch=8,
        chunks=4,
        input_bytes=10,
    )
    found = plan(profile, ["cpu", "cpu"], chunks=4, checkpoint="auto", memory=900, colocated=True)
    assert found.stage_checkpoints == ["units", "units"]
    assert [s.recompute_units for s in found.stages] == [[0, 1], [4, 5]]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    reference = copy.deepcopy(model)
    pipe = GPipe.from_plan(model, found)
    # The plan's model indices, as positions within each partition.
    assert pipe.checkpoint == ["units", "units"] and pipe.recompute == [[0, 1], [1, 2]]
    x = torch.randn(8, 4)
    out = pipe(x)
    expected = reference(x)
    assert_close64(out, expected)
    square_loss(out).backward()
    square_loss(expected).backward()
    _assert_same_state(pipe, reference)
    pipe.close()


def test_wrap_runs_units_planned_under_a_memory_cap() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 5)
    measured = wrap(ResidualMLP(), (x,), stages=2, chunks=4, checkpoint="never")
    profile = Profile.from_dict(measured.plan.profile)
    measured.close()
    # Fixed seconds (each unit alike) make the planner's choice the same on every run.
    for layer in profile.layers:
        layer.forward = [1e-3 * b for b in profile.batch_sizes]
        layer.backward = [2e-3 * b for b in profile.batch_sizes]
        layer.backward_input = None
    names = ["cpu", "cpu"]
    kept = plan(profile, names, chunks=4, checkpoint="never", colocated=True)
    # Just below what keeping everything needs: re-computing a unit frees far more.
    cap = int(max(stage.memory for stage in kept.stages)) - 1
    torch.manual_seed(1)
    model = ResidualMLP()
    reference = copy.deepcopy(model)
    wrapped = wrap(
        model, (x,), devices=names, chunks=4, checkpoint="auto", memory=cap, profile=profile
    )
    found = wrapped.plan
    assert "units" in found.stage_checkpoints
    assert wrapped.pipeline.recompute == [
        [u - stage.start for u in stage.recompute_units] for stage in found.stages
    ]
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    expected_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(STEPS):
        batch = torch.randn(8, 5) * (step + 1)
        out = wrapped(batch)
        expected = reference(batch)
        assert_close64(out, expected)
        square_loss(out).backward()
        square_loss(expected).backward()
        _assert_same_state(wrapped, reference)
        for opt in (optimizer, expected_optimizer):
            opt.step()
            opt.zero_grad()
    _assert_same_state_values(wrapped, reference)
    wrapped.close()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"checkpoint": "units"}, "partition 0 has checkpoint 'units' but recompute is not given"),
        (
            {"checkpoint": "units", "recompute": [[0]]},
            r"one list of layer positions per partition \(2\)",
        ),
        ({"checkpoint": "never", "recompute": [[0], []]}, "give it checkpoint 'units'"),
        ({"checkpoint": ["units", "units"], "recompute": [[0], []]}, r"recompute\[1\] is empty"),
        (
            {"checkpoint": "units", "recompute": [[3], [0]]},
            r"position 3 but partition 0 has 3 layers",
        ),
        ({"checkpoint": "units", "recompute": [[1, 1], [0]]}, "list each layer position once"),
        ({"checkpoint": "units", "recompute": [[True], [0]]}, "integer positions"),
        ({"checkpoint": "units", "recompute": [0, 1]}, "integer positions"),
        ({"checkpoint": "sometimes"}, "nor 'units' with recompute="),
    ],
)
def test_inconsistent_recompute_is_refused_in_one_line(options: dict[str, Any], match: str) -> None:
    model = nn.Sequential(*list(_mlp())[:6])
    with pytest.raises(ValueError, match=match) as error:
        GPipe(model, [3, 3], devices=["cpu", "cpu"], **options)
    assert "\n" not in str(error.value)


Pair = namedtuple("Pair", ["a", "b"])


class _ToPair(nn.Module):
    def forward(self, x: Tensor) -> Any:
        return Pair(x, x * 2)


class _Sum(nn.Module):
    def forward(self, pair: Any) -> Tensor:
        return pair.a + pair.b


class _ToList(nn.Module):
    def forward(self, x: Tensor) -> Any:
        return [x, x]


def test_a_recomputed_unit_refuses_what_it_cannot_pass_on() -> None:
    x = torch.randn(4, 3)
    for first in (_ToPair(), _ToList()):
        model = nn.Sequential(nn.Linear(3, 3), first, _Sum())
        pipe = GPipe(model, [3], devices=["cpu"], checkpoint="units", recompute=[[2]])
        with pytest.raises(TypeError, match="re-computed layer '2'|layer '2' is re-computed"):
            pipe(x)
        pipe.close()


def test_a_slice_of_a_partition_is_a_plain_sequential() -> None:
    part = RecomputedUnits(
        OrderedDict([("a", nn.Linear(2, 2)), ("b", nn.Tanh())]), [1], torch.device("cpu")
    )
    assert type(part[0:1]) is nn.Sequential and isinstance(part[1], nn.Tanh)
    assert "recompute=[1]" in repr(part)


@needs_cuda
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"]])
def test_cuda_units_replay_dropout_like_no_recomputation(devices: list[str]) -> None:
    results = []
    for recompute in (None, BN_RECOMPUTE):
        with GPipe(
            _bn_dropout(),
            [2, 4],
            devices=devices,
            chunks=3,
            checkpoint="never" if recompute is None else "units",
            recompute=recompute,
        ) as pipe:
            torch.manual_seed(5)
            out = pipe(torch.randn(9, 5))
            square_loss(out).backward()
            grads = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
            results.append((out.detach(), grads, pipe.state_dict()))
    (out, grads, state), (units_out, units_grads, units_state) = results
    assert_close64(units_out, out)
    assert len(units_grads) == len(grads) == len(list(_bn_dropout().parameters()))
    assert_close64(units_grads, grads)
    for key, value in state.items():
        assert_close64(units_state[key], value)
