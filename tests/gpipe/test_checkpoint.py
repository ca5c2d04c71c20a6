"""Tests for re-materialization with RNG restore."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from autopipe.gpipe.checkpoint import RNGState, checkpoint
from autopipe.gpipe.microbatch import Batch
from autopipe.microbatching.recomputation import is_recomputing
from tests.support.gpipe_support import CPU


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3)).double()


def test_matches_plain_run_with_dropout() -> None:
    net = _net()
    ref = copy.deepcopy(net)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()

    torch.manual_seed(1)
    out = checkpoint(net, Batch(x), CPU)
    assert out.atomic
    (out[0] ** 2).sum().backward()
    after = torch.rand(3)

    torch.manual_seed(1)
    ref_out = ref(x_ref)
    (ref_out**2).sum().backward()
    expected_after = torch.rand(3)

    assert torch.equal(out[0], ref_out)
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)
    for p, q in zip(net.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    # Recomputation replays the first run's random numbers and then puts the generator back.
    assert torch.equal(after, expected_after)


def test_keeps_only_the_input() -> None:
    net = _net()
    saved: list[Tensor] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(t)
        return t

    x = torch.randn(5, 4, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = checkpoint(net, Batch(x), CPU)
    assert len(saved) == 1 and saved[0] is x
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        net(x)
    assert len(saved) > 1  # the plain run keeps its activations
    out[0].sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_output_requires_grad_without_input_grad() -> None:
    out = checkpoint(nn.Linear(2, 2), Batch(torch.randn(3, 2)), CPU)
    assert out[0].requires_grad


def test_is_recomputing_only_in_backward() -> None:
    seen: list[bool] = []

    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(is_recomputing())
            return x * 2

    x = torch.randn(2, requires_grad=True)
    out = checkpoint(Spy(), Batch(x), CPU)
    out[0].sum().backward()
    assert seen == [False, True]
    assert not is_recomputing()
    assert x.grad is not None and torch.equal(x.grad, torch.full((2,), 2.0))


class _Pair(nn.Module):
    def forward(self, pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x, ids = pair
        return x * ids.unsqueeze(1), ids + 1


def test_tuple_with_integer_tensor() -> None:
    x = torch.randn(3, 2, requires_grad=True)
    ids = torch.arange(3)
    out = checkpoint(_Pair(), Batch((x, ids)), CPU)
    assert not out.atomic
    assert not out[1].requires_grad and out[1].tolist() == [1, 2, 3]
    out[0].sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, ids.unsqueeze(1).expand(3, 2).to(x.dtype))


def test_single_tuple_output_stays_tuple() -> None:
    out = checkpoint(lambda v: (v[0] * 2,), Batch((torch.randn(2, requires_grad=True),)), CPU)
    assert not out.atomic and len(out) == 1


def test_identity_output_can_be_modified_in_place() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 1
    out = checkpoint(nn.Identity(), Batch(y), CPU)
    z = out[0].relu_()  # would fail if the output were a view made by a custom Function
    z.sum().backward()
    assert x.grad is not None


def test_batch_norm_statistics_updated_once() -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(3).double()
    ref = copy.deepcopy(bn)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    checkpoint(bn, Batch(x), CPU)[0].sum().backward()
    ref(x.detach())
    assert bn.running_mean is not None and ref.running_mean is not None
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    assert bn.running_var is not None and ref.running_var is not None
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 1  # type: ignore[arg-type]


def test_rng_state_restored_block() -> None:
    state = RNGState(CPU)
    first = torch.rand(4)
    with state.restored():
        again = torch.rand(4)
    following = torch.rand(4)
    assert torch.equal(first, again)
    assert not torch.equal(first, following)
