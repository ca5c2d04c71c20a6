"""What the values of a traced graph hold (autopipe.graph.values): their kinds and sizes,
runs that leave no trace, the gradients that flow, and results compared to rounding."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.values import (
    ValueInfo,
    gradient_flow,
    record_values,
    run_quietly,
    same_results,
)


class Noisy(nn.Module):
    """Batch norm (its statistics move), dropout (it draws random numbers), a size read."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        y = nn.functional.dropout(self.norm(self.linear(x)), 0.5, self.training)
        return self.frozen(y).reshape(x.size(0), -1)


def test_value_info_kinds() -> None:
    assert ValueInfo.of(torch.ones(2, 3)) == ValueInfo("tensor", "Tensor", 24, (2, 3))
    assert ValueInfo.of(torch.Size([2, 3])).kind == "simple"
    assert ValueInfo.of((1, torch.float32, None)).kind == "simple"
    assert ValueInfo.of((torch.ones(1), torch.ones(1))).kind == "other"


def test_run_quietly_puts_back_buffers_and_random_state() -> None:
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first, buffers = run_quietly(model, model, x)
    second, _ = run_quietly(model, model, x)
    assert torch.equal(first, second)  # the same random numbers both times
    assert not first.requires_grad  # no autograd graph
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The buffers as the call left them: the statistics moved.
    assert not torch.equal(buffers[id(model.norm.running_mean)], before["norm.running_mean"])
    assert int(buffers[id(model.norm.num_batches_tracked)]) == 1
    # The caller's random stream is untouched.
    state = torch.random.get_rng_state()
    run_quietly(model, model, x)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_run_quietly_leaves_the_inputs_alone() -> None:
    x = torch.ones(3)
    result, _ = run_quietly(nn.Identity(), lambda t: t.mul_(2), x)
    assert x.tolist() == [1.0, 1.0, 1.0] and result.tolist() == [2.0, 2.0, 2.0]


def test_record_values_describes_every_node() -> None:
    torch.manual_seed(0)
    model, x = Noisy().eval(), torch.randn(8, 4)
    graph = fx.symbolic_trace(model)
    values, output, _ = record_values(graph, graph.graph, (x,))
    assert set(values) == {n.name for n in graph.graph.nodes}
    assert values["linear"] == ValueInfo("tensor", "Tensor", 8 * 3 * 4, (8, 3))
    assert values["size"] == ValueInfo("simple", "int")
    torch.testing.assert_close(output, model(x))


def test_gradient_flow_names_what_receives_a_gradient() -> None:
    model, x = Noisy().eval(), torch.randn(8, 4)
    flow = gradient_flow(model, lambda t: (model(t), t.sum(0).detach()), (x,))
    assert flow == {
        "output 0": True,
        "output 1": False,
        "linear.weight": True,
        "linear.bias": True,
        "norm.weight": True,
        "norm.bias": True,
        "input 0": True,
    }  # frozen's parameters do not require one: they are not asked


def test_gradient_flow_of_a_failing_call_is_none() -> None:
    def broken(t: Tensor) -> tuple[Tensor]:
        raise RuntimeError("no")

    assert gradient_flow(nn.Linear(2, 2), broken, (torch.ones(1, 2),)) is None


def test_same_results_compares_outputs_and_buffers_to_rounding() -> None:
    a, b = torch.ones(2), torch.ones(2) + 1e-7
    assert same_results(((a, 1), {1: a}), ((b, 2), {1: b}))  # constants are not compared
    assert not same_results(((a,), {}), ((a * 2,), {}))
    assert not same_results(((a,), {}), ((a, a), {}))
    assert not same_results(((a,), {1: a}), ((a,), {1: a * 2}))
    assert not same_results(((a,), {}), ((a,), {1: a}))  # a buffer the graph did not leave
    meta = torch.empty(2, device="meta")
    assert same_results(((meta,), {}), ((a,), {}))  # on meta: shapes and dtypes only
    assert not same_results(((meta,), {}), ((a.double(),), {}))
