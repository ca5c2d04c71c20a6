"""Tied parameters across stages: each later stage reads a copy, the parameter gets the sum."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from autopipe import PlanningError, plan
from autopipe.gpipe import GPipe
from autopipe.gpipe.wrapping import WrappedPipeline, wrap
from autopipe.graph import stage_of_units
from autopipe.graph.sequential import SequentialModel, prepare
from autopipe.graph.sharing import check_placement
from autopipe.planning.model.cut_rules import keep_together
from profiler.profile import Profile
from tests.support.float64 import assert_close64
from tests.support.wrap_models import SharedBias

pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype


class _Block(nn.Module):
    def __init__(self, width: int, shared: nn.Linear | None) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.shared = shared

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.fc(x))
        return x if self.shared is None else self.shared(x)


class SharedLinearEnds(nn.Module):
    """Four blocks; the first and the last call one and the same Linear."""

    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        shared = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            _Block(width, shared if i in (0, depth - 1) else None) for i in range(depth)
        )

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _gpt2() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], Tensor]]:
    transformers = pytest.importorskip("transformers")
    # The default config ties the LM head to the token embedding; only the sizes are small.
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=40, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 40, (4, 8))
    return model, (ids,), {"use_cache": False}, lambda out: out.logits.square().mean()


def _shared_linear() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], Tensor]]:
    model = SharedLinearEnds()
    return model, (torch.randn(6, 8),), {}, lambda out: (out - 0.5).square().mean()


def _shared_bias() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Callable[[Any], Tensor]]:
    model = SharedBias()
    return model, (torch.randn(6, 8),), {}, lambda out: (out - 0.5).square().mean()


MODELS = {"gpt2": _gpt2, "shared_linear": _shared_linear, "shared_bias": _shared_bias}
TIED = {
    "gpt2": {"transformer.wte.weight": (0, 1)},
    "shared_linear": {"blocks.0.shared.weight": (0, 1), "blocks.0.shared.bias": (0, 1)},
    # Every block reads the bias: whatever the split, both stages hold a copy.
    "shared_bias": {"bias": (0, 1)},
}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
}


def _copies_match(wrapped: WrappedPipeline, model: nn.Module) -> None:
    """Each later stage's copy is a tensor of its own, equal bit for bit to the parameter."""
    copies = wrapped.pipeline.__dict__["_replicas"].current()
    assert copies
    params = {id(p): p for p in model.parameters()}
    storage = {p.data_ptr() for p in params.values()}
    for name, stage, tensor in copies:
        assert stage > 0, name
        assert tensor.data_ptr() not in storage, name
        assert not isinstance(tensor, nn.Parameter)
        source = tensor.grad_fn.next_functions[0][0].variable if tensor.grad_fn else None
        assert source is not None and id(source) in params, name
        assert torch.equal(tensor.detach(), source.detach()), name


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("build", sorted(MODELS))
def test_training_equals_the_plain_model(build: str, optimizer: str, checkpoint: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs, loss_of = MODELS[build]()
    reference = copy.deepcopy(model)
    wrapped = wrap(
        model, args, kwargs=kwargs, stages=2, chunks=2, checkpoint=checkpoint,
        replicate_shared=True,
    )  # fmt: skip
    assert wrapped.replicated == TIED[build]
    assert list(wrapped.state_dict()) == list(reference.state_dict())
    assert [n for n, _ in wrapped.named_parameters()] == [
        n for n, _ in reference.named_parameters()
    ]
    ours, theirs = (
        OPTIMIZERS[optimizer](wrapped.parameters()),
        OPTIMIZERS[optimizer](reference.parameters()),
    )
    for _ in range(3):
        losses = []
        for net, opt in ((wrapped, ours), (reference, theirs)):
            opt.zero_grad()
            loss = loss_of(net(*args, **kwargs))
            loss.backward()
            if net is wrapped:  # the copies this step used: of the parameters as they were
                _copies_match(wrapped, model)
            opt.step()
            losses.append(loss.detach())
        assert_close64(losses[0], losses[1])
        for (name, p), (_, q) in zip(wrapped.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-9, atol=1e-10, msg=name)
    wrapped.close()


@pytest.mark.parametrize("build", sorted(MODELS))
def test_gradients_accumulate_over_calls_like_the_plain_model(build: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs, loss_of = MODELS[build]()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, args, kwargs=kwargs, stages=2, chunks=2, replicate_shared=True)
    for net in (wrapped, reference):
        for _ in range(2):  # no zero_grad between: the gradients add up
            loss_of(net(*args, **kwargs)).backward()
    for (name, p), (_, q) in zip(wrapped.named_parameters(), reference.named_parameters()):
        assert p.grad is not None, name
        assert_close64(p.grad, q.grad)
    wrapped.close()


@pytest.mark.parametrize("build", sorted(MODELS))
def test_a_plain_state_dict_sets_every_copy(build: str) -> None:
    torch.manual_seed(0)
    model, args, kwargs, _ = MODELS[build]()
    wrapped = wrap(model, args, kwargs=kwargs, stages=2, chunks=2, replicate_shared=True)
    torch.manual_seed(1)
    other, _, _, _ = MODELS[build]()
    wrapped.load_state_dict(other.state_dict())
    with torch.no_grad():
        out, expected = wrapped(*args, **kwargs), other(*args, **kwargs)
    expected = expected.logits if build == "gpt2" else expected
    assert_close64(out.logits if build == "gpt2" else out, expected)
    for name, _, tensor in wrapped.pipeline.__dict__["_replicas"].current():
        assert any(torch.equal(tensor, p) for p in other.parameters()), name
    wrapped.close()


def test_without_the_option_one_device_keeps_one_tensor() -> None:
    torch.manual_seed(0)
    wrapped = wrap(SharedLinearEnds(), (torch.randn(6, 8),), stages=2, chunks=2)
    assert wrapped.replicated == {} and wrapped.pipeline.replicated == {}
    wrapped.close()


def test_gpipe_of_a_sequential_with_a_tied_weight() -> None:
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), last)
    reference = copy.deepcopy(model)
    pipe = GPipe(model, [2, 3], devices=["cpu", "cpu"], chunks=2, replicate_shared=True)
    assert pipe.replicated == {"0.weight": (0, 1)}
    assert pipe.partitions[1][2] is not last and pipe[4] is not last
    assert list(pipe.state_dict()) == list(reference.state_dict())
    x = torch.randn(6, 4)
    for net in (pipe, reference):
        net(x).square().sum().backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        assert_close64(p.grad, q.grad)
    ((_, _, copied),) = pipe.__dict__["_replicas"].current()
    assert copied.data_ptr() != first.weight.data_ptr()
    twin = copy.deepcopy(pipe)  # the copies are graph nodes: deepcopy refuses those
    assert_close64(twin(x), pipe(x))
    ((_, _, copied),) = twin.__dict__["_replicas"].current()
    assert copied.data_ptr() != twin[0].weight.data_ptr() and twin[4] is not pipe[4]
    twin.close()
    # The clone follows the original layer's mode and dtype.
    pipe.eval()
    pipe.to(torch.float32)
    with torch.no_grad():
        assert pipe(x.float()).dtype == torch.float32
    ((_, _, copied),) = pipe.__dict__["_replicas"].current()
    assert copied.dtype == torch.float32 and not pipe.partitions[1][2].training
    pipe.close()


def test_a_shared_batch_norm_on_two_stages_is_refused() -> None:
    norm = nn.BatchNorm1d(4)
    model = nn.Sequential(norm, nn.Linear(4, 4), nn.Sequential(nn.Tanh(), norm))
    with pytest.raises(ValueError, match=r"running_mean .*running statistic of BatchNorm1d"):
        GPipe(model, [1, 2], devices=["cpu", "cpu"], replicate_shared=True)


class _CountedEnds(nn.Module):
    """The first and the last layer both add to one counter buffer."""

    calls: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.first, self.mid1, self.mid2, self.last = (nn.Linear(4, 4) for _ in range(4))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x) + self.calls
        self.calls.add_(1)
        x = self.last(torch.tanh(self.mid2(torch.tanh(self.mid1(x)))))
        return x + self.calls


def test_a_written_buffer_whose_users_no_split_keeps_together_is_refused() -> None:
    # The counter is read by mid1 and last: two stages can keep them together, not three.
    with pytest.raises(
        PlanningError, match=r"keeps on one stage the users of calls \(used by mid1, last\)"
    ):
        wrap(_CountedEnds(), (torch.randn(4, 4),), stages=3, chunks=2, replicate_shared=True)


class _Mark(nn.Module):
    """Writes its buffer in place, then reads it: the same value every call, so one
    tensor gives what the plain model computes, whatever the micro-batches."""

    seen: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        self.seen.fill_(1.0)
        return x * (1.0 + self.seen)


class _MarkedBlocks(nn.Module):
    """Five blocks; the first and the fourth end with one :class:`_Mark`."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        mark = _Mark()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), *([mark] if i in (0, 3) else []))
            for i in range(5)
        )

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_split_the_written_buffer_refused_is_planned_around_and_trains_exactly() -> None:
    torch.manual_seed(0)
    model, x = _MarkedBlocks(), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    # One device shares the buffer: any split is allowed. The profile is measured here.
    measured = wrap(copy.deepcopy(model), (x,), stages=2, chunks=2)
    data = measured.plan.profile
    measured.close()
    (tied,) = [t for t in data["tied"] if t["names"][0].endswith("seen")]
    (first, last), units = tied["layers"], len(data["layers"])
    assert 0 < first < last < units - 1 and "unsplit" not in tied
    # Equal units but a heavier first one: the best split of all cuts between the users.
    for i, layer in enumerate(data["layers"]):
        layer["forward"] = [2.0 if i == 0 else 1.0] * len(layer["forward"])
        layer["backward"] = [2.0 if i == 0 else 1.0] * len(layer["backward"])
    profile = Profile.from_dict(data)
    unconstrained = plan(profile, ["cpu", "cpu"], chunks=2).balance
    assert first < unconstrained[0] <= last
    # What the placement check refused: a copy of the buffer on the second stage.
    layout = prepare(copy.deepcopy(model), (x,))
    sequential = SequentialModel.of(layout)
    with pytest.raises(ValueError, match="written during forward"):
        check_placement(
            sequential.shared,
            stage_of_units(unconstrained),
            ["cpu", "cpu"],
            sequential.names,
            sequential.written,
            replicate=True,
        )
    wrapped = wrap(model, (x,), stages=2, chunks=2, profile=profile, replicate_shared=True)
    # Both users on one stage: the split the planner makes for the two stages taking turns
    # on the one CPU (wrap plans them colocated) once the buffer's users are kept together.
    balance = wrapped.plan.balance
    assert not first < balance[0] <= last
    kept = keep_together(profile, tied["names"][:1])
    assert balance == plan(kept, ["cpu", "cpu"], chunks=2, colocated=True).balance
    assert [t.unsplit for t in Profile.from_dict(wrapped.plan.profile).tied if t.buffer] == [True]
    ours = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for net, opt in ((wrapped, ours), (reference, theirs)):
            opt.zero_grad()
            (net(x) - 0.5).square().mean().backward()
            opt.step()
        for (name, p), (_, q) in zip(wrapped.named_parameters(), reference.named_parameters()):
            assert_close64(p.detach(), q.detach())
            assert p.grad is not None, name
    assert_close64(wrapped(x), reference(x))
    wrapped.close()


def test_under_autocast_the_copies_are_cast_as_the_parameter_is() -> None:
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    model, args, kwargs, loss_of = _shared_linear()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, args, stages=2, chunks=1, replicate_shared=True)
    for net in (wrapped, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(*args, **kwargs)
        assert out.dtype == torch.bfloat16
        loss_of(out.float()).backward()
    for (name, p), (_, q) in zip(wrapped.named_parameters(), reference.named_parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-4, msg=name)
    wrapped.close()


def test_deberta_v2_on_four_stages_trains_like_the_plain_model() -> None:
    """Every encoder layer reads ``encoder.rel_embeddings.weight``: each stage holding one
    gets a copy, counted in its memory, and the copies' gradients sum to the model's."""
    pytest.importorskip("transformers")
    from tests.support.hf_models import deberta_v2

    torch.manual_seed(0)
    model, args, _ = deberta_v2()
    reference = copy.deepcopy(model)
    target = torch.randn(4, 8, 32)
    wrapped = wrap(model, args, stages=4, chunks=2, replicate_shared=True)
    assert wrapped.units == ["embeddings", *(f"encoder.layer.{i}" for i in range(4))]
    stage = stage_of_units(wrapped.plan.balance)
    readers = tuple(sorted({stage[k] for k in range(1, 5)}))
    assert wrapped.replicated == {"encoder.rel_embeddings.weight": readers}
    # Each stage counts the table (4096 float64 bytes) once, with its gradient and Adam's
    # two moments, however many of its layers read it.
    profile, table = wrapped.plan.profile, 16 * 32 * 8
    (tied,) = profile["tied"]
    assert tied["bytes"] == table and tied["layers"] == [1, 2, 3, 4]
    assert wrapped.plan.optimizer == "adam"
    for s, planned in enumerate(wrapped.plan.stages):
        layers = profile["layers"][planned.start : planned.stop]
        users = len([k for k in range(planned.start, planned.stop) if k >= 1])
        params = sum(layer["param_bytes"] for layer in layers) - max(users - 1, 0) * table
        buffers = sum(layer["buffer_bytes"] for layer in layers)
        assert planned.param_memory == 4 * params + buffers, s
        assert planned.tied == (table if s in readers else 0), s
    ours = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        steps = []
        for net, opt in ((wrapped, ours), (reference, theirs)):
            opt.zero_grad()
            out = net(*args).last_hidden_state
            (out - target).square().mean().backward()
            opt.step()
            grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
            steps.append((out.detach(), grads, dict(net.named_parameters())))
        (out, grads, params), (out_ref, grads_ref, params_ref) = steps
        assert_close64(out, out_ref)
        assert grads.keys() == grads_ref.keys() and "encoder.rel_embeddings.weight" in grads
        # Far above the tolerance: the copies' gradients are compared, not rounding noise.
        assert grads_ref["encoder.rel_embeddings.weight"].abs().max() > 1e-3
        for name, grad in grads.items():
            torch.testing.assert_close(grad, grads_ref[name], rtol=1e-9, atol=1e-10, msg=name)
        for name, value in params.items():
            torch.testing.assert_close(value, params_ref[name], rtol=1e-9, atol=1e-10, msg=name)
    wrapped.close()
