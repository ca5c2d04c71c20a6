"""Padding uneven micro-batches for torch's pipeline stages."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.padding import MicroBatchPadding, per_batch_problem, rows_mixing_layer
from tests.support.dist_models import UNEVEN, make_batch, make_model, make_residual, reference_step


def test_sizes_follow_tensor_split_and_pad_with_the_last_real_row() -> None:
    padding = MicroBatchPadding(10, 4)
    assert padding.sizes == [3, 3, 2, 2] and padding.rows == 3 and not padding.even
    x = torch.arange(10.0).unsqueeze(1)
    (padded,) = padding.pad((x,))
    assert padded.squeeze(1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 9]
    even = MicroBatchPadding(12, 4)
    assert even.even and even.rows == 3
    assert even.pad((x,))[0] is x  # nothing to do


def test_more_chunks_than_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 3 rows into 4 micro-batches"):
        MicroBatchPadding(3, 4)


def test_padded_micro_batches_give_the_gradients_of_the_real_ones() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
    x, y = torch.randn(11, 5), torch.randn(11, 3)
    chunks = 4
    reference = torch.stack(
        [nn.functional.mse_loss(model(a), b) for a, b in zip(x.tensor_split(4), y.tensor_split(4))]
    ).mean()
    reference.backward()
    expected = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    padding = MicroBatchPadding(11, chunks)
    (px,) = padding.pad((x,))
    py = padding.pad_target(y)
    loss_fn = padding.loss(nn.functional.mse_loss)
    # As torch's schedules do: equal slices of the padded tensors, one loss each.
    losses = [loss_fn(model(a), b) for a, b in zip(px.tensor_split(4), py.tensor_split(4))]
    torch.stack(losses).mean().backward()
    torch.testing.assert_close(torch.stack(losses).mean(), reference.detach())
    for got, want in zip(model.parameters(), expected):
        torch.testing.assert_close(got.grad, want)


def test_micro_batch_found_by_offset_or_else_by_order() -> None:
    padding = MicroBatchPadding(7, 3)  # sizes 3, 2, 2
    target = padding.pad_target(torch.randn(7, 2))
    parts = target.tensor_split(3)
    assert [padding.micro_batch(parts[i]) for i in (2, 0, 1)] == [2, 0, 1]
    padding.pad_target(torch.randn(7, 2))  # a new step restarts the count
    copies = [part.clone() for part in parts]
    assert [padding.micro_batch(c) for c in copies] == [0, 1, 2]


def test_outputs_are_cut_to_the_real_rows() -> None:
    padding = MicroBatchPadding(5, 2)  # sizes 3, 2
    target = padding.pad_target(torch.zeros(5, 1))
    seen = []

    def record(output: tuple[torch.Tensor, torch.Tensor], tgt: torch.Tensor) -> torch.Tensor:
        seen.append((output[0].shape[0], output[1].shape, tgt.shape[0]))
        return output[0].sum()

    loss = padding.loss(record)
    aux = torch.zeros(4)  # not batched: left alone
    for part in target.tensor_split(2):
        loss((torch.zeros(3, 2), aux), part)
    assert seen == [(3, (4,), 3), (2, (4,), 2)]


def test_batchnorm_is_found_as_mixing_rows() -> None:
    layers = [("a", nn.Linear(2, 2)), ("b", nn.Sequential(nn.BatchNorm1d(2))), ("c", nn.ReLU())]
    assert rows_mixing_layer(layers) == "b"
    assert rows_mixing_layer([("a", nn.LayerNorm(2))]) is None


# ---------------------------------------------------------------- over processes (gloo)


@pytest.mark.parametrize("kind", ["sequential", "wrapped"])
def test_uneven_micro_batches_equal_one_process(equal_run: Any, kind: str) -> None:
    _, results = equal_run
    x, y = make_batch()
    x, y = x[:UNEVEN], y[:UNEVEN]
    model = make_model(batchnorm=False) if kind == "sequential" else make_residual()
    x = x if kind == "sequential" else x[:, :5]
    loss = reference_step(model, x, y)  # the same micro-batches: 4, 4, 3, 3 rows
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(results[-1]["uneven"][kind]["loss"], loss, rtol=1e-5, atol=1e-6)
    if kind == "sequential":  # a second step adds the same gradients again
        reference_step(model, x, y)
    seen = set()
    for rank in results:
        part = rank["uneven"][kind]
        for name, grad in part["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
            if kind == "sequential":
                twice = model.get_parameter(name).grad
                torch.testing.assert_close(part["twice"][name], twice, rtol=1e-5, atol=1e-6)
            seen.add(name)
    assert seen == set(once)


def test_uneven_micro_batches_are_planned_padded(equal_run: Any) -> None:
    _, results = equal_run
    planned, padded, full = results[0]["uneven"]["plan"]
    # 4, 4, 3 and 3 rows run as 4 each: timed as 4 micro-batches of 4, not their mean.
    assert planned == pytest.approx(padded) and padded == pytest.approx(full)


def test_uneven_micro_batches_with_batchnorm_are_refused(equal_run: Any) -> None:
    _, results = equal_run
    for rank in results:
        message = rank["uneven"]["batchnorm"]
        assert f"batch size {UNEVEN} is not a multiple of chunks=4" in message
        assert "'3' has BatchNorm" in message and "padding rows" in message


def test_outputs_computed_per_micro_batch_need_even_micro_batches() -> None:
    assert per_batch_problem(["['aux_loss']"], 8, 4) is None
    assert per_batch_problem([], 7, 4) is None
    problem = per_batch_problem(["['aux_loss']"], 7, 4)
    assert problem is not None and "['aux_loss'] are computed from whole micro-batches" in problem
