"""A BatchNorm CNN trained through wrap() and two gloo ranks, against the plain model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe import wrap
from tests.support.batchnorm_workers import BatchNormCNN, batch_norms, image_batches, make_bn_cnn
from tests.support.dist_models import CHUNKS, loss_fn, reference_step
from tests.support.dist_workers import launch

STEPS = 3


def _optimizer(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _reference(chunks: int) -> BatchNormCNN:
    """The plain model trained on the same batches.

    With one micro-batch, simply so. With more, each micro-batch is normalized with its own
    statistics, as in any pipeline, and the running statistics move once per step, from
    the whole mini-batch (:func:`tests.support.dist_models.whole_batch_statistics`).
    """
    model = make_bn_cnn()
    optimizer = _optimizer(model.parameters())
    for x, y in image_batches(STEPS):
        if chunks == 1:
            loss_fn(model(x), y).backward()
        else:
            reference_step(model, x, y, chunks=chunks)
        optimizer.step()
        optimizer.zero_grad()
    return model


def _compare(state: dict[str, Tensor], reference: nn.Module, exact: bool) -> None:
    expected = reference.state_dict()
    assert list(state) == list(expected)
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    for key, value in expected.items():
        torch.testing.assert_close(state[key], value, **tolerance, msg=key)  # type: ignore[arg-type]
    # Once per step: every layer counted STEPS batches, whatever the micro-batches.
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            assert int(value) == STEPS, key


@pytest.mark.parametrize("checkpoint", ["except_last", "never"])
@pytest.mark.parametrize("chunks", [CHUNKS, 1])
def test_wrap_trains_like_the_plain_model(chunks: int, checkpoint: str) -> None:
    model = make_bn_cnn()
    batches = image_batches(STEPS)
    wrapped = wrap(model, batches[0][0], stages=2, chunks=chunks, checkpoint=checkpoint)
    optimizer = _optimizer(wrapped.parameters())
    try:
        for x, y in batches:
            loss_fn(wrapped(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        reference = _reference(chunks)
        _compare(wrapped.state_dict(), reference, exact=chunks == 1)
        # Evaluation uses the running statistics: the same outputs as the plain model's.
        wrapped.eval()
        reference.eval()
        x = batches[0][0]
        torch.testing.assert_close(wrapped(x), reference(x), rtol=1e-4, atol=1e-5)
    finally:
        wrapped.close()
    assert all(type(m) in (nn.BatchNorm1d, nn.BatchNorm2d) for m in batch_norms(model))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    workdir = tmp_path_factory.mktemp("batchnorm-training")
    runs = launch("batchnorm-training", 2, workdir, limit=150)
    for rank, run in enumerate(runs):
        assert run.returncode == 0, f"rank {rank} failed:\n{run.output[-3000:]}"
    return [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("chunks", [CHUNKS, 1])
def test_two_ranks_train_like_the_plain_model(two_ranks: list[Any], chunks: int) -> None:
    state = two_ranks[0][f"chunks={chunks}"]
    assert two_ranks[1][f"chunks={chunks}"] is None  # gathered on rank 0
    # The ranks compute with one thread each; so does the reference, so that one micro-batch
    # can be compared bit for bit (kernels sum in another order on more threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = _reference(chunks)
    finally:
        torch.set_num_threads(threads)
    _compare(state, reference, exact=chunks == 1)
