"""Outputs that are not one row per sample (a router's logits per token, a 0-d loss the model
computes) travel batch-major through the pipeline and come back as the model returns them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from autopipe.gpipe.wrapping import wrap
from autopipe.graph.flat_io import MEAN, ROWS
from autopipe.graph.tracing import trace
from tests.support.moe_runner_models import Routed

pytestmark = pytest.mark.usefixtures("float64")


def _sample(batch: int = 4) -> Tensor:
    return torch.randn(batch, 5, 6, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("method", ["fx", "export"])
def test_router_logits_and_a_0d_loss_leave_the_graph_batch_major(method: str) -> None:
    torch.manual_seed(0)
    model, x = Routed(), _sample()
    traced = trace(model, (x,), method=method)
    # out, four blocks' router logits, aux: each graph output has the batch along dim 0.
    assert traced.outputs.kinds == {1: ROWS, 2: ROWS, 3: ROWS, 4: ROWS, 5: MEAN}
    (output,) = traced.graph.find_nodes(op="output")
    shapes = [traced.values[n.name].shape for n in output.args[0]]
    assert shapes == [(4, 5, 6)] + [(4, 5, 3)] * 4 + [(4,)]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_wrapped_model_returns_them_as_the_plain_model_per_micro_batch(method: str) -> None:
    torch.manual_seed(0)
    model, x = Routed(), _sample()
    plain = copy.deepcopy(model)
    wrapped = wrap(model, (x,), stages=2, chunks=2, method=method)
    assert wrapped.method == method and wrapped.plan.balance == [2, 2]
    ours = wrapped(x)
    whole = plain(x)
    # Router logits are per token: the micro-batches' rows joined are the whole batch's.
    assert [t.shape for t in ours["router"]] == [(20, 3)] * 4
    for mine, theirs in zip(ours["router"], whole["router"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    # The 0-d loss is computed per micro-batch (from its own tokens), then averaged.
    parts = [plain(part) for part in x.tensor_split(2)]
    per_micro_batch = torch.stack([p["aux"] for p in parts]).mean()
    torch.testing.assert_close(ours["aux"], per_micro_batch, rtol=1e-15, atol=0)
    assert not torch.allclose(ours["aux"], whole["aux"])  # a whole-batch statistic differs
    (ours["out"].square().mean() + ours["aux"]).backward()
    sum(p["out"].square().mean() / 2 + p["aux"] / 2 for p in parts).backward()
    reference = dict(plain.named_parameters())
    for name, param in wrapped.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=1e-12, atol=1e-15)
    wrapped.close()


class _OnlyLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x).square().mean()


class _Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        y = self.lin(x)
        return y, y.transpose(0, 1)  # tokens along dim 0: 5 rows for a batch of 4


@pytest.mark.parametrize("method", ["fx", "export"])
def test_outputs_that_cannot_follow_the_batch_are_refused(method: str) -> None:
    with pytest.raises(ValueError, match=r"are 0-d tensors .* no output has just the batch"):
        trace(_OnlyLoss(), (_sample(),), method=method)
    with pytest.raises(ValueError, match=r"output \[1\] has 5 rows along dim 0 for a batch of 4"):
        trace(_Transposed(), (_sample(),), method=method)
    # 8 tokens along dim 0, twice the batch but not per sample: fx's graph keeps no sizes,
    # so the trace runs it again on 2 samples (8 rows still); export's keeps 8 constant.
    tokens = torch.randn(4, 8, 6)
    with pytest.raises(ValueError, match=r"output \[1\] has 8 rows along dim 0 for a batch of 4"):
        trace(_Transposed(), (tokens,), method=method)
