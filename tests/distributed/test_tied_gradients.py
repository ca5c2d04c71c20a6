"""Tied parameters across ranks: a copy on each rank using it, trained as the plain model's."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe.distributed.tied_gradients import shared_across_stages, shared_state, written_shared
from tests.support.dist_models import reference_step, titan_position
from tests.support.dist_workers import scenario_results
from tests.support.tied_workers import (
    SHARED_CHUNKS,
    SHARED_NAMES,
    SHARED_RUNS,
    SHARED_STEPS,
    TIED_STEPS,
    TiedBlock,
    make_optimizer,
    mse,
    shared_case,
    tied_case,
    tied_runs,
)


def test_only_written_buffers_on_two_ranks_are_refused() -> None:
    shared = nn.Linear(4, 4)
    norm = nn.BatchNorm1d(4)
    layers = [TiedBlock(shared, 4), nn.Sequential(norm), nn.ReLU(), TiedBlock(shared, 4), norm]
    assert shared_state(layers[:4], [1, 3]) is None  # a parameter: copied to both ranks
    problem = shared_state([layers[1], layers[2], layers[4]], [1, 2])
    assert problem is not None and "buffer 0.running_mean of layer 0" in problem
    assert "stages 0, 1" in problem
    # Stages 0 and 2 on one rank (virtual stages, K=2) share one tensor.
    assert shared_state([layers[1], layers[2], layers[4]], [1, 1, 1], ranks=2) is None
    # A buffer the trace shows is only read may be copied.
    assert shared_state([layers[1], layers[2], layers[4]], [1, 2], written=set()) is None
    # The planner keeps the users of a written buffer on one stage, by the owner's names.
    owner = nn.Sequential(layers[1], layers[2], layers[4])
    assert written_shared(list(owner), None, owner) == {
        f"{where}.{name}"
        for where in ("0.0", "2")
        for name in ("running_mean", "running_var", "num_batches_tracked")
    }
    assert written_shared(list(owner), set(), owner) == set()
    assert written_shared(layers[:4], None, nn.Sequential(*layers[:4])) == set()  # parameters
    ties = shared_across_stages(layers[:4], [1, 1, 1, 1], 2)
    assert [(t is shared.weight, where) for t, where in ties] == [(True, (0, 1)), (False, (0, 1))]


@contextmanager
def one_thread() -> Iterator[None]:
    """One thread, as each rank runs: the reference's sums come in the ranks' order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def reference(kind: str, optimizer: str) -> dict[str, Any]:
    """The plain model trained as the workers train the pipeline (D replicas of b rows in
    M/D micro-batches are the same M micro-batches of the whole batch)."""
    with one_thread():
        model, loss_fn, x, y = tied_case(kind)
        reference_step(model, x, y, loss=loss_fn)
        reference_step(model, x, y, loss=loss_fn)
        twice = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        opt = make_optimizer(optimizer, model.parameters())
        steps = []
        for _ in range(TIED_STEPS):
            loss = reference_step(model, x, y, loss=loss_fn)
            opt.step()
            opt.zero_grad()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            steps.append({"loss": loss, "params": params})
        return {"twice": twice, "steps": steps, "keys": list(model.state_dict())}


def close(actual: Tensor, expected: Tensor, name: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=name)


def check_tied(results: list[dict[str, Any]], world: int) -> None:
    tied = {"linear": "0.shared.weight", "linear3": "0.shared.weight"}
    tied["gpt2"] = "transformer.wte.weight"
    for index, run in enumerate(tied_runs(world)):
        k = world // run["d"]
        for optimizer in ("adam", "sgd"):
            key = f"{index} {optimizer}"
            ref = reference(run["kind"], optimizer)
            ranks = [result[key] for result in results]
            if "balance" in run:
                assert ranks[0]["balance"] == run["balance"] and ranks[0]["stages"] == [0, 2]
            holders = [r for r, part in enumerate(ranks) if tied[run["kind"]] in part["twice"]]
            d = run["d"]
            where = [titan_position(r, k, d) for r in range(k * d)]
            replica0 = [where[r][0] for r in holders if where[r][1] == 0]
            assert replica0 == [0, k - 1], key  # the tied weight: on the first and last stage
            for rank, part in enumerate(ranks):
                for name, grad in part["twice"].items():
                    close(grad, ref["twice"][name], f"{key} rank {rank} {name}")
                for step, (mine, theirs) in enumerate(zip(part["steps"], ref["steps"])):
                    if where[rank][0] == k - 1:
                        close(mine["loss"], theirs["loss"], f"{key} step {step} loss")
                    for name, value in mine["params"].items():
                        close(value, theirs["params"][name], f"{key} step {step} {name}")
            held = set().union(*(part["steps"][0]["params"] for part in ranks))
            assert held == set(ref["steps"][0]["params"]), key
            # Every copy, on every rank and replica, is bitwise the same after every step.
            for step in range(TIED_STEPS):
                copies: dict[str, list[Tensor]] = {}
                for part in ranks:
                    for name, value in part["steps"][step]["params"].items():
                        copies.setdefault(name, []).append(value)
                assert len(copies[tied[run["kind"]]]) == 2 * run["d"], key
                for name, values in copies.items():
                    assert all(torch.equal(v, values[0]) for v in values), f"{key} {name}"
            state = ranks[0]["state"]
            assert list(state) == ref["keys"], key  # lm_head.weight as well
            final = ref["steps"][-1]["params"]
            for name, value in final.items():
                close(state[name], value, f"{key} state {name}")
            if run["kind"] == "gpt2":
                assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    refused = results[0]["refused"]
    assert "keeps on one stage the users of 0.1.running_mean (used by 0, 3); " in refused
    assert "each is written in place during forward" in refused and "use one stage" in refused


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def tied_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    pytest.importorskip("transformers")
    world = request.param
    workdir = tmp_path_factory.mktemp(f"tied{world}")
    return world, scenario_results("tied", world, workdir, limit=300)


def test_tied_parameters_train_as_the_plain_model(
    tied_run: tuple[int, list[dict[str, Any]]],
) -> None:
    world, results = tied_run
    check_tied(results, world)


@functools.cache
def shared_reference(kind: str) -> dict[str, Any]:
    """The plain model trained in one process as the ranks train the pipeline."""
    with one_thread():
        model, x, y = shared_case(kind)

        def step() -> Tensor:
            pairs = zip(x.tensor_split(SHARED_CHUNKS), y.tensor_split(SHARED_CHUNKS))
            loss = torch.stack([mse(model(xb), yb) for xb, yb in pairs]).mean()
            loss.backward()
            return loss.detach()

        first = step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for _ in range(SHARED_STEPS):
            loss = step()
            opt.step()
            opt.zero_grad()
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            steps.append({"loss": loss, "params": params})
        return {"first": first, "grads": grads, "steps": steps, "keys": list(model.state_dict())}


def exact(actual: Tensor, expected: Tensor, name: str) -> None:
    """float64 equality up to the order of a few additions (micro-batches, ranks)."""
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12, msg=name)


def test_a_parameter_every_layer_reads_trains_as_the_plain_model(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    results = scenario_results("shared", 2, tmp_path, limit=300)
    for index, run in enumerate(SHARED_RUNS):
        ref, shared = shared_reference(run["kind"]), SHARED_NAMES[run["kind"]]
        ranks = [result[index] for result in results]
        key = f"{run['kind']} {run['schedule']}"
        assert [part["balance"] for part in ranks] == [run["balance"]] * 2, key
        # Both ranks read the parameter: each holds a copy and gets the model's gradient.
        assert all(shared in part["grads"] for part in ranks), key
        assert ref["grads"][shared].abs().max() > 1e-3, key  # far above the tolerance
        exact(ranks[1]["first"], ref["first"], f"{key} loss")
        for rank, part in enumerate(ranks):
            for name, grad in part["grads"].items():
                exact(grad, ref["grads"][name], f"{key} rank {rank} {name}")
            for step, (mine, theirs) in enumerate(zip(part["steps"], ref["steps"])):
                if rank == 1:
                    exact(mine["loss"], theirs["loss"], f"{key} step {step} loss")
                for name, value in mine["params"].items():
                    exact(value, theirs["params"][name], f"{key} step {step} {name}")
        held = set().union(*(part["grads"] for part in ranks))
        assert held == set(ref["grads"]), key
        for step in range(SHARED_STEPS):
            copies = [part["steps"][step]["params"][shared] for part in ranks]
            assert torch.equal(copies[0], copies[1]), f"{key} step {step}"
        # The model's keys first, in its order; what the stages hold that the model does not
        # name (export's lifted constants, non-persistent buffers) follows, as they hold it.
        state = ranks[0]["state"]
        assert list(state)[: len(ref["keys"])] == ref["keys"], key
        for name, value in ref["steps"][-1]["params"].items():
            exact(state[name], value, f"{key} state {name}")
