"""The searched configuration, built on every rank."""

from __future__ import annotations

from typing import Any

import torch

from tests.support.dist_models import make_batch, make_model, reference_step


def test_searched_configuration_equals_one_process(equal_run: Any) -> None:
    world, results = equal_run
    runs = [rank["searched"] for rank in results]
    devices, replicas, chunks, _ = runs[0]["config"]
    assert devices == world and all(run["config"] == runs[0]["config"] for run in runs)
    # D replicas of M micro-batches: the mean loss over D·M equal micro-batches, in order.
    model = make_model()
    x, y = make_batch()
    loss = reference_step(model, x, y, chunks=replicas * chunks)
    once = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    last = [run["loss"] for run in runs if run["loss"] is not None]
    assert last and all(torch.allclose(value, loss, rtol=1e-5, atol=1e-6) for value in last)
    for run in runs:
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "rank 0 found no configuration" in runs[0]["error"]
