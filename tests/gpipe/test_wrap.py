"""wrap(): traced models pipelined with GPipe give the original outputs and gradients."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from autopipe.gpipe import GPipe
from autopipe.gpipe.wrapping import WrappedPipeline, prepare, wrap
from autopipe.graph.stage_modules import UnitModule
from autopipe.graph.tracing import TracingError
from autopipe.planning.model.plans import Plan
from profiler.profile import Profile
from tests.support.float64 import assert_close64, square_loss
from tests.support.tuple_models import (
    AttentionStack,
    DataclassBlock,
    DataclassBlocks,
    DictBlock,
    DictBlocks,
    GRUStack,
    LSTMStack,
    NestedLSTM,
    StateBlock,
    StateSkip,
)
from tests.support.wrap_models import (
    DataDependent,
    DropoutBatchNorm,
    KeywordModel,
    ResidualMLP,
    ShapeLoop,
    TiedEnds,
    TinyGPT,
    UNet,
)

pytestmark = pytest.mark.usefixtures("float64")  # float64 as the default dtype


def _compare(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> tuple[WrappedPipeline, nn.Module]:
    """Wraps ``model`` and checks one forward and backward against a copy of it."""
    reference = copy.deepcopy(model)
    wrapped = wrap(model, args, kwargs=kwargs, **options)
    output = wrapped(*args, **(kwargs or {}))
    expected = reference(*args, **(kwargs or {}))
    assert pytree.tree_structure(output) == pytree.tree_structure(expected)
    assert_close64(pytree.tree_leaves(output), pytree.tree_leaves(expected))
    square_loss(output).backward()
    square_loss(expected).backward()
    _check_grads(wrapped, reference)
    return wrapped, reference


def _check_grads(wrapped: nn.Module, reference: nn.Module) -> None:
    ours = dict(wrapped.named_parameters())
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        if param.grad is None:
            assert ours[name].grad is None, name
        else:
            assert_close64(ours[name].grad, param.grad)


@pytest.mark.parametrize(("stages", "chunks"), [(2, 1), (3, 2), (4, 3)])
def test_residual_mlp(stages: int, chunks: int) -> None:
    torch.manual_seed(0)
    wrapped, _ = _compare(ResidualMLP(), (torch.randn(6, 5),), stages=stages, chunks=chunks)
    assert wrapped.method == "fx"
    assert isinstance(wrapped.pipeline, GPipe) and isinstance(wrapped.plan, Plan)
    assert len(wrapped.plan.balance) == stages and sum(wrapped.plan.balance) == 6
    assert wrapped.units == ["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out"]
    assert wrapped.plan.chunks == chunks and wrapped.pipeline.chunks == chunks
    wrapped.close()


def test_training_steps_stay_in_step_with_the_original() -> None:
    torch.manual_seed(0)
    model = ResidualMLP()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    wrapped = wrap(model, (x,), stages=3, chunks=4)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        for net, optimizer in ((wrapped, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            (net(x) - y).square().mean().backward()
            optimizer.step()
    for ours, theirs in zip(wrapped.parameters(), reference.parameters()):
        assert_close64(ours, theirs)
    wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_gpt_with_tied_embedding_and_head(method: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(depth=2)
    idx = torch.randint(0, 32, (6, 8))
    wrapped, _ = _compare(model, (idx,), stages=3, chunks=3, method=method)
    assert wrapped.method == method
    assert wrapped.units == ["wte", "wpe", "drop", "blocks.0", "blocks.1", "ln_f", "lm_head"]
    # The tied weight is one parameter, shared by the first and the last stage.
    assert wrapped.get_parameter("lm_head.weight") is wrapped.get_parameter("wte.weight")
    assert "blocks.0.attn.qkv.weight" in dict(wrapped.named_parameters())
    state = wrapped.state_dict()
    assert list(state) == list(TinyGPT(depth=2).state_dict())
    fresh = TinyGPT(depth=2)
    fresh.load_state_dict(state)
    assert_close64(fresh(idx), wrapped(idx))
    other = TinyGPT(depth=2)
    wrapped.load_state_dict(other.state_dict())
    assert_close64(wrapped(idx), other(idx))
    wrapped.close()


def test_unet_with_long_skips() -> None:
    torch.manual_seed(0)
    wrapped, _ = _compare(UNet(), (torch.randn(4, 3, 16, 16),), stages=3, chunks=2)
    assert wrapped.method == "fx"
    wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_batch_norm_in_eval_mode(method: str) -> None:
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.3)
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    wrapped = wrap(model, (x,), stages=2, chunks=1, method=method)
    # One training step moves the running statistics, as in the original model; with one
    # micro-batch the dropout masks are drawn in the same order.
    for net in (wrapped, reference):
        torch.manual_seed(1)
        net(x).sum().backward()
    for ours, theirs in zip(wrapped.buffers(), reference.buffers()):
        assert_close64(ours, theirs)
    wrapped.eval()
    reference.eval()
    assert not any(m.training for m in wrapped.pipeline.modules())
    assert_close64(wrapped(x), reference(x))
    with torch.no_grad():
        assert_close64(wrapped(x[:5]), reference(x[:5]))
    wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_batch_norm_in_train_mode(method: str, checkpoint: str) -> None:
    # One micro-batch sees the whole batch, so batch statistics equal the original's.
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.0)
    wrapped, reference = _compare(
        model, (torch.randn(6, 8),), stages=3, chunks=1, checkpoint=checkpoint, method=method
    )
    # Recomputation in backward must not update the running statistics twice.
    for (name, ours), theirs in zip(wrapped.named_buffers(), reference.buffers()):
        assert name in dict(reference.named_buffers())
        assert_close64(ours, theirs)
    wrapped.close()


def test_a_squeeze_cnn_is_measured_as_the_command_line_measures_it() -> None:
    """Its last BatchNorm sees a 1x1 map: never measured at a batch of one."""
    from profiler.measure import profile_model
    from tests.support.cnn_models import squeeze_cnn

    torch.manual_seed(0)
    model, sample = squeeze_cnn(), torch.randn(8, 3, 16, 16)
    wrapped = wrap(model, sample, stages=2, chunks=4)
    try:
        assert wrapped.plan.micro_batch == 2
        assert wrapped.plan.profile["batch_sizes"] == [2, 4]
        units = nn.Sequential(*(u for part in wrapped.pipeline.partitions for u in part))
        assert profile_model(units, sample, chunks=4, warmup=0).batch_sizes == [2, 4]
        wrapped(sample).sum().backward()
    finally:
        wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_dropout_is_replayed_by_checkpointing(method: str) -> None:
    x = torch.randn(6, 8)
    results = []
    for checkpoint in ("always", "never"):
        torch.manual_seed(0)
        model = DropoutBatchNorm(p=0.5)
        # A fixed split: a profile-driven one may differ between the runs, and with it the
        # order in which micro-batches draw their dropout masks.
        wrapped = wrap(
            model,
            (x,),
            stages=2,
            chunks=2,
            checkpoint=checkpoint,
            method=method,
            strategy="uniform",
        )
        torch.manual_seed(1)
        output = wrapped(x)
        output.square().sum().backward()
        results.append((output.detach(), [p.grad for p in wrapped.parameters()]))
        wrapped.close()
    (out_a, grads_a), (out_b, grads_b) = results
    assert_close64(out_a, out_b)
    assert_close64(grads_a, grads_b)
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.5)
    with torch.no_grad():
        plain = model.eval()(x)
    assert not torch.allclose(out_a, plain)


def test_keyword_inputs_and_structured_outputs() -> None:
    torch.manual_seed(0)
    x, mask = torch.randn(6, 4), torch.rand(6)
    kwargs = {"mask": mask, "scale": 2.0}
    wrapped, _ = _compare(KeywordModel(), (x,), kwargs, stages=2, chunks=3)
    output = wrapped(x, scale=2.0, mask=mask)  # keyword order does not matter
    assert set(output) == {"logits", "hidden", "scale"}
    assert isinstance(output["hidden"], tuple) and output["scale"] == 2.0
    with pytest.raises(ValueError, match="baked into the graph"):
        wrapped(x, mask=mask, scale=3.0)
    with pytest.raises(ValueError, match="structure"):
        wrapped(x, mask=mask, scale=2.0, extra=torch.zeros(6, 6))
    wrapped.close()


def test_model_fx_cannot_trace_goes_through_export() -> None:
    torch.manual_seed(0)
    wrapped, _ = _compare(ShapeLoop(), (torch.randn(6, 3, 4),), stages=2, chunks=3)
    assert wrapped.method == "export"
    wrapped.close()


def test_untraceable_model_and_the_leaf_fix() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    with pytest.raises(TracingError, match="leaf_modules"):
        wrap(DataDependent(), (x,))
    wrapped, _ = _compare(DataDependent(), (x,), stages=2, chunks=2, leaf_modules=["gate"])
    assert wrapped.units == ["a", "gate", "b"]
    wrapped.close()


def test_shared_parameter_on_one_device_is_allowed() -> None:
    torch.manual_seed(0)
    wrapped, _ = _compare(TiedEnds(), (torch.randn(4, 4),), stages=2, chunks=2)
    assert wrapped.plan.balance[0] < 4  # first and last are on different stages
    wrapped.close()


def test_shared_parameter_across_devices_is_replicated() -> None:
    x = torch.randn(4, 4)
    profile = wrap(TiedEnds(), (x,), stages=2).plan.profile
    model = TiedEnds()
    wrapped = wrap(model, (x,), devices=["cpu", "meta"], profile=Profile.from_dict(profile))
    # The first stage keeps the parameter; the last reads a copy on its own device.
    assert list(wrapped.pipeline.replicated.values()) == [(0, 1)]
    assert model.first.weight.device.type == "cpu" and model.last.weight is model.first.weight
    # Every other layer is on its stage's device (the split follows the measured times).
    (holder,) = [stage.index for stage in wrapped.plan.stages if "mid2" in stage.layers]
    assert model.mid2.weight.device.type == ["cpu", "meta"][holder]
    wrapped.close()


def test_profile_reuse_and_mismatch() -> None:
    x = torch.randn(6, 5)
    first = wrap(ResidualMLP(), (x,), stages=3, chunks=2)
    profile = Profile.from_dict(first.plan.profile)
    again = wrap(ResidualMLP(), (x,), stages=3, chunks=2, profile=profile)
    assert again.plan.balance == first.plan.balance
    with pytest.raises(ValueError, match="not the model's units"):
        wrap(ResidualMLP(depth=2), (x,), stages=2, profile=profile)


def test_profiled_under_autocast_and_trained_under_it() -> None:
    # float32: autocast leaves the tests' default float64 alone.
    x = torch.randn(6, 5, dtype=torch.float32)
    model = ResidualMLP().float()
    reference = copy.deepcopy(model)
    wrapped = wrap(model, (x,), stages=2, chunks=2, autocast="bfloat16")
    assert wrapped.plan.profile["autocast"] == "bfloat16"
    profile = Profile.from_dict(wrapped.plan.profile)
    again = wrap(
        ResidualMLP().float(), (x,), stages=2, chunks=2, profile=profile, autocast="bfloat16"
    )
    assert again.plan.balance == wrapped.plan.balance
    again.close()
    with pytest.raises(ValueError, match="made with autocast bfloat16, not float16"):
        wrap(ResidualMLP().float(), (x,), stages=2, chunks=2, profile=profile, autocast="float16")
    with pytest.raises(ValueError, match="autocast must be bfloat16 or float16"):
        wrap(ResidualMLP().float(), (x,), stages=2, autocast="half")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapped(x)
        expected = torch.cat([reference(part) for part in x.tensor_split(2)])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    wrapped.close()


@pytest.mark.parametrize(
    ("build", "options", "match"),
    [
        (lambda: ResidualMLP(depth=1), {"stages": 4}, "too few for 4 stages"),
        (lambda: ResidualMLP(), {"stages": 2, "devices": ["cpu"]}, "stages=2"),
        (lambda: ResidualMLP(), {"granularity": "rows"}, "granularity"),
    ],
)
def test_bad_arguments(build: Callable[[], nn.Module], options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wrap(build(), (torch.randn(4, 5),), **options)


def test_outputs_must_be_batch_major() -> None:
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.a(x)).mean()

    with pytest.raises(ValueError, match="batch-major"):
        wrap(WithLoss(), (torch.randn(4, 4),))


def test_moving_and_converting() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNorm()
    reference = copy.deepcopy(model).float().eval()
    x = torch.randn(6, 8)
    wrapped = wrap(model, (x,), stages=2)
    with pytest.raises(TypeError, match="cannot be moved"):
        wrapped.to("cpu")
    with pytest.raises(TypeError, match="cannot be moved"):
        wrapped.cpu()
    wrapped.to(torch.float32).eval()
    # The model's buffers follow the converted tensors the units run with.
    assert wrapped.scale.dtype == torch.float32 and model.scale.dtype == torch.float32
    assert wrapped.state_dict()["layers.0.1.running_mean"].dtype == torch.float32
    assert_close64(wrapped(x.float()), reference(x.float()))
    wrapped.close()


def test_eval_mode_at_wrap_time() -> None:
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.5).eval()
    x = torch.randn(6, 8)
    wrapped, _ = _compare(model, (x,), stages=2, chunks=2)
    assert not wrapped.training
    wrapped.train()
    assert wrapped(x).shape == (6, 2)
    wrapped.close()


def test_hugging_face_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=40,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 40, (4, 8))
    wrapped, _ = _compare(model, (ids,), {"use_cache": False}, stages=2, chunks=2)
    assert "transformer.h.0" in wrapped.units and "lm_head" in wrapped.units
    assert list(wrapped.state_dict()) == list(model.state_dict())
    wrapped.close()


def _hugging_face(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    """A small Hugging Face model from its config (random weights, no download)."""
    transformers = pytest.importorskip("transformers")
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3}
    small["num_attention_heads"] = 4
    torch.manual_seed(0)
    if name == "llama":
        config = transformers.LlamaConfig(
            **small, num_key_value_heads=2, vocab_size=50, max_position_embeddings=32
        )
        config.use_cache = False
        cls, inputs = transformers.LlamaForCausalLM, (torch.randint(0, 50, (4, 8)),)
    elif name == "falcon":  # constant index tensors in its code
        config = transformers.FalconConfig(**small, vocab_size=50)
        config.use_cache = False
        cls, inputs = transformers.FalconForCausalLM, (torch.randint(0, 50, (4, 8)),)
    elif name == "bert":
        config = transformers.BertConfig(
            **small, vocab_size=50, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        cls, inputs = transformers.BertForSequenceClassification, (torch.randint(0, 50, (4, 8)),)
    else:
        config = transformers.ViTConfig(
            **small,
            image_size=16,
            patch_size=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        cls, inputs = transformers.ViTForImageClassification, (torch.randn(4, 3, 16, 16),)
    config._attn_implementation = "eager"
    return cls(config), inputs


@pytest.mark.parametrize("name", ["llama", "falcon", "bert", "vit"])
def test_hugging_face_models(name: str) -> None:
    model, inputs = _hugging_face(name)
    wrapped, reference = _compare(model, inputs, stages=2, chunks=2)
    assert len(wrapped.plan.balance) == 2
    assert list(wrapped.state_dict()) == list(reference.state_dict())
    wrapped.close()


def _train_like_the_original(
    model: nn.Module, x: Tensor, units: int, **options: Any
) -> WrappedPipeline:
    """Wraps ``model``, checks its units, outputs and gradients, then one optimizer step."""
    wrapped, reference = _compare(model, (x,), **options)
    assert sum(wrapped.plan.balance) == units
    assert list(wrapped.state_dict()) == list(reference.state_dict())
    for net in (wrapped, reference):
        torch.optim.SGD(net.parameters(), lr=0.1).step()
        net.zero_grad()
    assert_close64(wrapped(x), reference(x))
    return wrapped


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("method", ["fx", "export"])
def test_stacked_lstms_are_cut_between(method: str, stages: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, 4)
    wrapped = _train_like_the_original(LSTMStack(), x, 4, stages=stages, chunks=2, method=method)
    assert len(wrapped.plan.balance) == stages
    wrapped.close()


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize(
    ("build", "shape", "units"),
    [
        (GRUStack, (4, 5, 4), 3),
        (NestedLSTM, (4, 1, 4), 3),  # its final hidden state is used after the next layer
        (AttentionStack, (4, 5, 8), 4),  # the attention weights are never used
    ],
)
def test_modules_returning_tuples_are_cut_between(
    build: Callable[[], nn.Module], shape: tuple[int, ...], units: int, method: str
) -> None:
    torch.manual_seed(0)
    wrapped = _train_like_the_original(
        build(), torch.randn(*shape), units, stages=units, chunks=2, method=method
    )
    wrapped.close()


def test_attention_blocks_at_leaf_granularity_through_export() -> None:
    torch.manual_seed(0)
    # MultiheadAttention reads its out_proj's weights without calling it.
    x = torch.randn(4, 5, 8)
    options = {"method": "export", "granularity": "leaves"}
    wrapped = _train_like_the_original(AttentionStack(), x, 4, stages=4, chunks=2, **options)
    names = [m.name for m in wrapped.pipeline.modules() if isinstance(m, UnitModule)]
    assert names == ["attns.0", "attns.1", "attns.2", "head"]
    wrapped.close()


@pytest.mark.parametrize(
    ("build", "options"),
    [
        (StateSkip, {"method": "fx"}),
        (StateSkip, {"method": "export"}),
        (StateSkip, {"method": "fx", "leaf_modules": [StateBlock]}),
        (DictBlocks, {"method": "fx", "leaf_modules": [DictBlock]}),
        (DictBlocks, {"method": "export"}),
        (DataclassBlocks, {"method": "fx", "leaf_modules": [DataclassBlock]}),
        (DataclassBlocks, {"method": "export"}),
    ],
)
def test_blocks_returning_structures_are_cut_between(
    build: Callable[[], nn.Module], options: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model = build()
    units = len(list(model.get_submodule("blocks"))) + 1
    x = torch.randn(4, 6)
    wrapped = _train_like_the_original(model, x, units, stages=units, chunks=2, **options)
    wrapped.close()


@pytest.mark.parametrize("leaves", [[], [StateBlock]])
def test_a_state_used_two_blocks_later_is_carried(leaves: list[type[nn.Module]]) -> None:
    layout = prepare(StateSkip(), torch.randn(4, 6), method="fx", leaf_modules=leaves)
    assert layout.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    # The first block's state crosses the second block to the third; the unused states of
    # the second and fourth blocks cross nothing.
    assert [len(crossing) for crossing in layout.liveness["any"].crossing] == [2, 2, 2, 1]
    assert layout.boundary_bytes() == [2 * 4 * 6 * 8] * 3 + [4 * 6 * 8]


def test_too_few_units_advises_only_what_can_help() -> None:
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match=r"at most 3 stages or granularity='leaves' \(5 units\)"):
        wrap(ResidualMLP(depth=1), (x,), stages=4)
    with pytest.raises(ValueError, match="too few for 6 stages; use at most 3 stages$"):
        wrap(ResidualMLP(depth=1), (x,), stages=6)

    class Split(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, ...]:
            return x.chunk(2, dim=-1)

    class Join(nn.Module):
        def forward(self, parts: tuple[Tensor, ...]) -> Tensor:
            return torch.cat(parts, dim=-1)  # the tuple itself crosses

    class SplitJoin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 4), nn.Linear(4, 4)
            self.split, self.join = Split(), Join()

        def forward(self, x: Tensor) -> Tensor:
            return self.b(self.join(self.split(self.a(x))))

    merged = r"at most 3 stages; boundaries that cannot be cut were merged \(split \| join: non-t"
    for granularity in ("children", "blocks", "leaves"):
        with pytest.raises(ValueError, match=merged):
            wrap(SplitJoin(), (x,), stages=4, granularity=granularity)


@pytest.mark.parametrize("leaf", [True, False])
def test_blocks_returning_a_hugging_face_model_output(leaf: bool) -> None:
    outputs = pytest.importorskip("transformers.modeling_outputs")

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(6, 6)

        def forward(self, x: Tensor) -> Any:
            y = self.inner(x)
            return outputs.BaseModelOutput(last_hidden_state=y.tanh(), hidden_states=(y, y.sin()))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))
            self.head = nn.Linear(6, 2)

        def forward(self, x: Tensor) -> Tensor:
            for block in self.blocks:
                out = block(x)  # read by attribute, by index and through a nested tuple
                x = out.last_hidden_state + out[0] * out.hidden_states[1]
            return self.head(x)

    torch.manual_seed(0)
    options = {"method": "fx", "leaf_modules": [Block] if leaf else []}
    wrapped = _train_like_the_original(Model(), torch.randn(4, 6), 4, stages=4, chunks=2, **options)
    wrapped.close()


@pytest.mark.parametrize("kind", ["sequential", "two inputs", "one tuple"])
def test_sample_is_the_models_positional_inputs(kind: str) -> None:
    from tests.support.dist_models import TwoInputs, make_concat

    a, b = torch.randn(8, 8), torch.randn(8, 3)
    models: dict[str, tuple[nn.Module, tuple[Any, ...]]] = {
        "sequential": (nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), (a,)),
        "two inputs": (TwoInputs(), (a, b)),  # its first layer takes both
        "one tuple": (make_concat(), ((a, b),)),  # its first layer takes the tuple
    }
    model, sample = models[kind]
    reference = copy.deepcopy(model)
    wrapped = wrap(model, sample, stages=2, chunks=2)
    out = wrapped(*sample)
    expected = reference(*sample)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    wrapped.close()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_stages_on_one_device_are_planned_to_take_turns() -> None:
    x = torch.randn(8, 5)
    # "cpu:0" is the same CPU: the plan names both stages "cpu" and prices their turns.
    wrapped = wrap(ResidualMLP(), (x,), devices=["cpu", "cpu:0"], chunks=2)
    plan = wrapped.plan
    assert [device.name for device in plan.devices] == ["cpu", "cpu"]
    assert plan.shared == [[0, 1]] and wrapped.pipeline.shared_devices == [[0, 1]]
    times = [stage.time for stage in plan.stages]
    assert plan.pipeline_time == pytest.approx(plan.chunks * sum(times), rel=1e-12)
    assert plan.num_devices == 1
