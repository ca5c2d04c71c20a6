"""The stages' modules: names, slices, boundary specs, re-computation, fingerprints."""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import nn

from autopipe.distributed.stage import (
    LossRecorder,
    StageModule,
    compare_fingerprints,
    fingerprint,
    layer_output_specs,
    merge_state_dicts,
)
from tests.support.dist_models import CHUNKS, make_model, reference_steps


def test_stage_module_keeps_names_and_computes_the_slice() -> None:
    model = make_model()
    model.eval()
    layers = list(model.named_children())
    stage = StageModule(layers[2:5])
    assert list(stage.state_dict()) == [
        k for k in model.state_dict() if k.split(".")[0] in {"2", "3", "4"}
    ]
    x = torch.randn(4, 16)
    torch.testing.assert_close(stage(x), model[2:5](x))


def test_stage_module_packs_tuple_inputs() -> None:
    class Add(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] + pair[1]

    stage = StageModule([("add", Add())], tuple_input=True)
    a, b = torch.ones(2), torch.full((2,), 2.0)
    torch.testing.assert_close(stage(a, b), torch.full((2,), 3.0))


def test_output_specs_leave_model_and_rng_untouched() -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    specs = layer_output_specs(list(model), x)
    assert [s[0][0][0] for s in specs] == [(4, 16)] * 7 + [(4, 3)]
    assert all(s[0][0][1] == torch.float32 and s[0][0][2] for s in specs)
    assert not any(is_tuple for _, is_tuple in specs)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_output_specs_under_autocast_have_its_dtypes() -> None:
    specs = layer_output_specs(list(make_model(batchnorm=False)), torch.randn(4, 8), "bfloat16")
    dtypes = [s[0][0][1] for s in specs]
    # Linear computes in bfloat16, and the layers after it keep the dtype they are given.
    assert dtypes == [torch.bfloat16] * 8
    assert not torch.is_autocast_enabled("cpu")


ORDERS = {  # a stage's forwards and backwards of 4 micro-batches, as schedules run them
    "gpipe": [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)],
    "1f1b": [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_checkpointed_stage_module_equals_the_plain_one(mode: str, order: str) -> None:
    from autopipe.distributed.stage import StageModule

    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3)]
    xs = torch.randn(16, 8).chunk(4)
    results = []
    for checkpoint in ("never", mode):
        stage = StageModule(
            [(str(i), copy.deepcopy(layer)) for i, layer in enumerate(layers)],
            checkpoint=checkpoint,
            chunks=4,
        )
        torch.manual_seed(1)  # the same dropout masks; a re-computation replays its own
        outputs = {}
        for op, i in ORDERS[order]:
            if op == "F":
                outputs[i] = stage(xs[i])
            else:
                outputs[i].pow(2).sum().backward()
        results.append((stage, torch.cat([outputs[i] for i in range(4)])))
    (plain, out), (checkpointed, again) = results
    torch.testing.assert_close(again, out)
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name)  # batch-norm statistics updated once
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        torch.testing.assert_close(b.grad, a.grad)
    assert checkpointed.checkpointed == (4 if mode == "always" else 3)
    with pytest.raises(ValueError, match="unknown checkpoint mode 'sometimes'"):
        StageModule([], checkpoint="sometimes")


def test_merge_state_dicts_rejects_overlap() -> None:
    merged = merge_state_dicts([{"0.weight": 1}, {"2.weight": 2}])
    assert list(merged) == ["0.weight", "2.weight"]
    with pytest.raises(ValueError, match=r"0\.weight"):
        merge_state_dicts([{"0.weight": 1}, {"0.weight": 2}])


def test_fingerprints_name_the_difference() -> None:
    a = fingerprint(OrderedDict(make_model().named_children()), chunks=4)
    b = fingerprint(OrderedDict(make_model(width=12).named_children()), chunks=4)
    assert compare_fingerprints([a, a]) is None
    message = compare_fingerprints([a, a, b])
    assert message is not None and "rank 2" in message and "0.weight" in message
    assert "chunks" in (compare_fingerprints([a, {**a, "chunks": 2}]) or "")


def test_loss_recorder_scales_and_averages() -> None:
    recorder = LossRecorder(lambda out, tgt: (out - tgt).abs().sum(), chunks=2)
    assert recorder(torch.tensor(3.0), torch.tensor(1.0)).item() == 1.0
    recorder(torch.tensor(5.0), torch.tensor(1.0))
    assert recorder.mean().item() == 3.0


@pytest.mark.parametrize(
    "key", ["always 1f1b", "except_last gpipe", "auto 1f1b", "except_last gpipe x2"]
)
def test_checkpointed_stages_equal_one_process(equal_run: Any, key: str) -> None:
    world, results = equal_run
    loss, once, twice, state = reference_steps()
    runs = [rank["checkpointed"][key] for rank in results]
    torch.testing.assert_close(runs[-1]["loss"], loss, rtol=1e-5, atol=1e-6)
    for run in runs:
        for name, grad in run["grads"].items():
            torch.testing.assert_close(grad, once[name], rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(run["twice"][name], twice[name], rtol=1e-5, atol=1e-6)
    # Batch-norm statistics were updated once per step, not again when recomputed.
    gathered = runs[0]["state"]
    for name, value in state.items():
        torch.testing.assert_close(gathered[name], value, rtol=1e-5, atol=1e-6, msg=name)
    mode = key.split()[0]
    stages = world * (2 if key.endswith("x2") else 1)
    counts = [count for run in runs for _, count in run["checkpointed"]]
    if mode == "always":  # every micro-batch of both steps, on every stage
        assert counts == [2 * CHUNKS] * stages
    elif mode == "except_last":
        assert counts == [2 * (CHUNKS - 1)] * stages
        # It spares the micro-batch whose backward comes first: torch's GPipe goes
        # backward in order, looped BFS in reverse.
        first = CHUNKS - 1 if key.endswith("x2") else 0
        assert [s for run in runs for s in run["spared"]] == [first] * stages
    else:  # no memory limit: auto needs no re-computation
        assert runs[0]["plan"] == "auto" and counts == [0] * stages


def test_unknown_checkpoint_mode_is_refused(equal_run: Any) -> None:
    _, results = equal_run
    for rank in results:
        assert "unknown checkpoint mode 'sometimes'" in rank["checkpointed"]["error"]


def test_torch_split_backward_re_runs_a_checkpointed_forward_in_each_part() -> None:
    # Why the runner re-computes nothing under zbv and dualpipev: the gradients come out
    # right, but the forward runs again for the input's gradient and again for the
    # weights' (once per parameter group), not once with the activations kept until W.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from autopipe.distributed.stage import split_backward_problem

    torch.manual_seed(0)
    layers = [nn.Linear(4, 8).double(), nn.Tanh(), nn.Linear(8, 3).double()]
    plain = StageModule([(str(i), layer) for i, layer in enumerate(layers)])
    again = StageModule(
        [(str(i), copy.deepcopy(layer)) for i, layer in enumerate(layers)], checkpoint="always"
    )
    x = torch.randn(5, 4, dtype=torch.float64)
    grad = torch.randn(5, 3, dtype=torch.float64)
    plain(x).backward(grad)
    runs = []
    original = again._run
    again._run = lambda *args: (runs.append(1), original(*args))[1]  # type: ignore[method-assign]
    inputs = x.clone().requires_grad_(True)
    out = again(inputs)
    _, groups = stage_backward_input([out], [grad], [inputs], again.parameters())
    after_input = len(runs)
    stage_backward_weight(again.parameters(), groups, retain_graph=False)
    for a, b in zip(plain.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
    assert after_input == 2 and len(runs) > after_input  # re-run in I, and again for W
    assert "splits each backward" in (split_backward_problem("zbv", "always") or "")
    assert split_backward_problem("dualpipev", "never") is None
    assert split_backward_problem("1f1b", "always") is None
