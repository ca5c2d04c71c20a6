"""DistributedPipeline of a model built on the meta device: each rank materializes its stages."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from tests.support.dist_models import CHUNKS, assert_close
from tests.support.meta_workers import LR, STEPS, launch
from tests.support.tied_workers import tied_case

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The meta scenarios on two gloo ranks, one result per rank."""
    return launch(2, tmp_path_factory.mktemp("meta"), limit=400)


def _train(model: nn.Module, loss_fn: Any, x: Tensor, y: Tensor) -> list[Tensor]:
    """The plain model trained as the pipeline trains: the mean of the micro-batch losses."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: sums in the same order
    try:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for _ in range(STEPS):
            pairs = zip(x.tensor_split(CHUNKS), y.tensor_split(CHUNKS))
            loss = torch.stack([loss_fn(model(xb), yb) for xb, yb in pairs]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        return losses
    finally:
        torch.set_num_threads(threads)


def _matches(results: list[dict[str, Any]], model: nn.Module, losses: list[Tensor]) -> None:
    last = results[-1]
    for got, want in zip(last["losses"], losses):
        assert_close(got, want, "loss")
    params = dict(model.named_parameters())
    for result in results:
        for name, value in result["params"].items():
            assert_close(value, params[name].detach(), name)
    gathered = results[0]["state"]
    state = model.state_dict()
    assert list(gathered) == list(state)
    for key, value in state.items():
        assert_close(gathered[key], value, key)


@pytest.mark.parametrize("run", ["loaded", "virtual"])
def test_a_meta_gpt2_loaded_per_rank_trains_like_the_real_one(
    ranks: list[dict[str, Any]], run: str
) -> None:
    results = [r[run] for r in ranks]
    model, loss_fn, x, y = tied_case("gpt2")
    keys = set(model.state_dict())
    named = {n for n, _ in model.named_parameters()}
    parts = [{k for part in r["parts"] for k in part} for r in results]
    for result, part in zip(results, parts):
        assert len(result["parts"]) == len(result["stages"])  # one init call per stage
        assert not result["meta left"]
        assert set(result["names"]) <= part  # a rank holds its own stages' tensors only
    # Together the whole model; apart only the tied embedding and head, a copy on each.
    assert parts[0] | parts[1] == keys
    assert parts[0] & parts[1] == {"transformer.wte.weight", "lm_head.weight"}
    names = [set(r["names"]) for r in results]
    assert names[0] | names[1] == named and names[0] & names[1] == {"transformer.wte.weight"}
    _matches(results, model, _train(model, loss_fn, x, y))


def test_without_init_the_tied_copies_start_equal_and_train_like_the_plain_model(
    ranks: list[dict[str, Any]],
) -> None:
    results = [r["default"] for r in ranks]
    first, second = (r["start"]["transformer.wte.weight"] for r in results)
    torch.testing.assert_close(first, second, rtol=0, atol=0)  # the first holder's, broadcast
    assert all(not r["parts"] and not r["meta left"] for r in results)
    model, loss_fn, x, y = tied_case("gpt2")
    start = {**results[0]["start"], **results[1]["start"]}
    assert set(start) == {n for n, _ in model.named_parameters()}
    model.load_state_dict(start, strict=False)  # every parameter; GPT-2 has no buffers
    _matches(results, model, _train(model, loss_fn, x, y))


def test_a_tensor_nothing_initializes_is_refused_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    messages = [r["refused"] for r in ranks]
    assert all("nothing initializes scale" in m and "pass init=" in m for m in messages)
    assert messages[0].startswith("rank 1: ")  # the rank holding it says which


def test_a_stage_larger_than_the_free_memory_is_refused_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    messages = [r["short"][0] for r in ranks]
    first = ranks[0]["short"][1][0]  # the layers of stage 0, as rank 0 planned them
    layers = "layer 0" if first == 1 else f"layers 0..{first - 1}"
    # Every rank raises rank 0's line (the others naming it), none waits on another.
    assert messages[0].startswith(f"materializing stage 0 ({layers}) on cpu"), messages
    assert messages[1] == "rank 0: " + messages[0]
    assert all(
        re.search(r"on cpu for its [\d.]+ KiB of parameters and buffers needs", m) for m in messages
    )
    assert all("free memory there" in m for m in messages)
