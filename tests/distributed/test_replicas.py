"""Replicas: K·D ranks, D copies of a K-stage pipeline kept identical."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import Tensor

from autopipe.distributed.replicas import (
    ReplicaLayout,
    _buckets,
    check_layout,
    position_rank,
    rank_position,
    replica_batch,
    take_shard,
)
from autopipe.distributed.setup import check_sizes
from tests.support.dist_models import (
    BATCH,
    REPLICA_CHUNKS,
    assert_close,
    loss_fn,
    make_batch,
    make_model,
    tiny_plan,
    titan_position,
    whole_batch_statistics,
)
from tests.support.dist_workers import scenario_results


def test_replica_checks() -> None:
    check_sizes(2, 8, None, "1f1b", 2, data_parallel=2)  # 1f1b needs chunks >= K, not K·D
    with pytest.raises(ValueError, match="4 ranks = 2 replicas of 2 stages"):
        check_sizes(2, 8, tiny_plan(data_parallel=2, stages=4), "gpipe", 4, data_parallel=2)
    assert check_layout(6, 3, None, None) == 2
    with pytest.raises(ValueError, match="not a multiple of data_parallel=4"):
        check_layout(6, 4, 4, None)
    with pytest.raises(ValueError, match="plan was made for data_parallel=1"):
        check_layout(4, 2, 2, tiny_plan())
    assert check_layout(4, 2, None, tiny_plan(data_parallel=2)) == 2  # D from the plan


@pytest.mark.parametrize(("k", "d", "t"), [(2, 2, 1), (3, 2, 1), (2, 3, 2), (1, 2, 2), (4, 1, 1)])
def test_ranks_take_torchtitans_mesh_order(k: int, d: int, t: int) -> None:
    # pp outermost, tp innermost: a stage's D·t ranks are consecutive, its t tensor ranks too.
    for rank in range(k * d * t):
        stage, replica, tensor = rank_position(rank, d, t)
        assert (stage, replica, tensor) == titan_position(rank, k, d, t)
        assert position_rank(stage, replica, d, tensor, t) == rank


def test_replica_batch_and_shards() -> None:
    assert replica_batch(16, 2, 4, None) == 8  # a multiple of D·chunks: the global batch
    assert replica_batch(12, 2, 4, None) == 12  # else one replica's shard
    assert replica_batch(16, 1, 4, None) == 16
    layout = ReplicaLayout(2, 2, 1, 1, None, None)
    x = torch.arange(16.0).unsqueeze(1)
    torch.testing.assert_close(take_shard(x, layout, 8, "inputs"), x[8:])
    pair = take_shard((x, x), layout, 8, "inputs")
    assert isinstance(pair, tuple) and torch.equal(pair[1], x[8:])
    assert take_shard(x[:8], layout, 8, "inputs") is not None
    with pytest.raises(ValueError, match=r"batch size 16 .* or 8 "):
        take_shard(x[:4], layout, 8, "inputs")


def test_buckets_split_by_size_and_dtype() -> None:
    tensors = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(1)]
    sizes = [[t.numel() for t in bucket] for bucket in _buckets(tensors, limit=32)]
    assert sizes == [[4, 4], [4], [1]]
    assert [len(b) for b in _buckets(tensors, limit=16)] == [1, 1, 1, 1]


@pytest.fixture(scope="module")
def replica_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("replicas")
    return scenario_results("replicas", 4, workdir, limit=90)


@functools.cache
def _replica_reference(d: int = 2) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor], Any]:
    """One process: loss and gradients after one step, gradients and state after two.

    Gradients: the mean over all D·M micro-batch losses, replica r's micro-batches being
    ``x[r*b:(r+1)*b].tensor_split(M)``, back-propagated once per step. BatchNorm
    statistics: one update per step from the global mini-batch.
    """
    model = make_model()
    x, y = make_batch()
    b = BATCH // d
    shards = [(x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]) for r in range(d)]

    def step() -> Tensor:
        m = REPLICA_CHUNKS
        split = [(xs.tensor_split(m), ys.tensor_split(m)) for xs, ys in shards]
        pairs = [pair for xs, ys in split for pair in zip(xs, ys)]
        with whole_batch_statistics(model):
            loss = torch.stack([loss_fn(model(xb), yb) for xb, yb in pairs]).mean()
            loss.backward()
        return loss.detach()

    loss = step()
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    step()
    twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, once, twice, model.state_dict()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_replicas_equal_one_process(replica_run: list[dict[str, Any]], schedule: str) -> None:
    loss, once, twice, state = _replica_reference()
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for rank, result in enumerate(replica_run):
        stage, replica, _ = titan_position(rank, 2, 2)  # K=2 x D=2, torchtitan's order
        run = result[schedule]
        if stage == 1:  # the last stage of each replica: the loss of all replicas
            assert_close(run["loss"], loss)
            # Each replica's shard instead of the global batch:
            assert_close(run["shard loss"], loss)
        else:
            assert run["loss"] is None and run["shard loss"] is None
        for name, grad in run["grads"].items():
            assert_close(grad, once[name], name)
            assert_close(run["twice"][name], twice[name], name)  # added up, not averaged again
            assert_close(run["shard"][name], once[name], name)
            assert_close(run["unequal"][name], once[name] + replica + 1, name)
            seen[replica].add(name)
        for key, value in run["own state"].items():  # every replica holds the same state
            assert_close(value, state[key], key)
    assert seen[0] == seen[1] == set(once)
    gathered = replica_run[0][schedule]["state"]
    assert list(gathered) == list(state)
    for key, value in state.items():
        assert_close(gathered[key], value, key)
    assert all(r[schedule]["state"] is None for r in replica_run[1:])


def test_replica_layout_and_plan(replica_run: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(replica_run):
        data_parallel, global_batch, batch, text = result["layout"]
        assert (data_parallel, global_batch, batch) == (2, BATCH, BATCH // 2)
        stage, replica, _ = titan_position(rank, 2, 2)
        assert f"stage {stage}/2, replica {replica}/2" in text


def test_replica_mismatches_are_reported_on_every_rank(replica_run: list[dict[str, Any]]) -> None:
    for result in replica_run:
        errors = result["errors"]
        assert "batch size 16" in errors["step"] and "or 8" in errors["step"]
        assert "4 ranks, not a multiple of data_parallel=3" in errors["world"]
        assert "plan was made for data_parallel=1 but data_parallel=2" in errors["plan"]
        assert "data_parallel differs between rank 0 and rank 1" in errors["ranks"]
