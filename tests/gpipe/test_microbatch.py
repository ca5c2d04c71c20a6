"""Tests for splitting mini-batches into micro-batches and joining outputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.gpipe.microbatch import Batch, check, gather, scatter


def test_batch_wraps_tensor_and_tuple() -> None:
    x = torch.zeros(2)
    atomic = Batch(x)
    assert atomic.atomic and atomic.value is x and len(atomic) == 1 and atomic[0] is x
    pair = Batch((x, x))
    assert not pair.atomic and pair.value == (x, x) and list(pair) == [x, x]
    assert pair.replace((x,)).value == (x,)
    assert atomic.replace((x,)).value is x


def test_call_checks_output_type() -> None:
    batch = Batch(torch.zeros(2))
    assert batch.call(lambda v: v + 1)[0].tolist() == [1.0, 1.0]
    with pytest.raises(TypeError, match="partition's output"):
        batch.call(lambda v: [v])


@pytest.mark.parametrize("bad", [[torch.zeros(1)], (), (torch.zeros(1), 3), 1.0, None])
def test_check_rejects_non_tensors(bad: object) -> None:
    with pytest.raises(TypeError, match="Tensor"):
        check(bad)


@pytest.mark.parametrize(
    ("size", "chunks", "expected"),
    [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1]), (5, 1, [5]), (1, 3, [1])],
)
def test_scatter_sizes(size: int, chunks: int, expected: list[int]) -> None:
    batches = scatter(torch.arange(size), chunks)
    assert [b[0].size(0) for b in batches] == expected
    assert torch.equal(torch.cat([b[0] for b in batches]), torch.arange(size))


def test_scatter_makes_views() -> None:
    x = torch.zeros(6, 2)
    (first, *_) = scatter(x, 3)
    assert first[0].data_ptr() == x.data_ptr()


def test_scatter_tuple() -> None:
    x, ids = torch.randn(5, 3), torch.arange(5)
    batches = scatter((x, ids), 2)
    assert all(not b.atomic for b in batches)
    assert [b[1].tolist() for b in batches] == [[0, 1, 2], [3, 4]]


def test_scatter_errors() -> None:
    with pytest.raises(ValueError, match="batch dimension"):
        scatter(torch.tensor(1.0), 2)
    with pytest.raises(ValueError, match="disagree"):
        scatter((torch.zeros(2), torch.zeros(3)), 2)
    with pytest.raises(ValueError, match="empty"):
        scatter(torch.zeros(0, 3), 2)


def test_gather_tensor_and_tuple() -> None:
    a, b = torch.ones(2, 1), torch.zeros(1, 1)
    assert gather([Batch(a), Batch(b)]).shape == (3, 1)  # type: ignore[union-attr]
    out = gather([Batch((a, a)), Batch((b, b))])
    assert isinstance(out, tuple) and len(out) == 2 and out[1].shape == (3, 1)
    single = gather([Batch((a,))])
    assert isinstance(single, tuple) and single[0] is a


def test_gather_errors() -> None:
    with pytest.raises(ValueError, match="structure"):
        gather([Batch(torch.zeros(1)), Batch((torch.zeros(1),))])
    with pytest.raises(ValueError, match="zero-dimensional"):
        gather([Batch(torch.tensor(1.0)), Batch(torch.tensor(2.0))])


@settings(max_examples=50, deadline=None)
@given(size=st.integers(1, 40), chunks=st.integers(1, 12))
def test_scatter_gather_round_trip(size: int, chunks: int) -> None:
    x = torch.arange(size * 2).view(size, 2)
    batches = scatter((x, x[:, 0]), chunks)
    assert len(batches) == min(size, chunks)
    sizes = [b[0].size(0) for b in batches]
    assert max(sizes) - min(sizes) <= 1
    joined = gather(batches)
    assert isinstance(joined, tuple)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], x[:, 0])
