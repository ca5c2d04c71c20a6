"""Tracing for wrap(): torch.fx first, torch.export as the fallback, clear errors otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

from autopipe.graph.layout import model_mode
from autopipe.graph.sequential import unit_sequential
from autopipe.graph.tracing import TracingError, trace
from tests.support.wrap_models import (
    DataDependent,
    DropoutBatchNorm,
    Gate,
    KeywordModel,
    ResidualMLP,
    ShapeLoop,
)


def _run(traced_root: nn.Module, graph: fx.Graph, *inputs: Tensor) -> tuple[Tensor, ...]:
    return tuple(fx.GraphModule(traced_root, graph)(*inputs))


def test_fx_is_tried_first() -> None:
    model = ResidualMLP().double()
    x = torch.randn(6, 5, dtype=torch.float64)
    traced = trace(model, (x,))
    assert traced.method == "fx"
    assert traced.batch == 6 and traced.training
    assert len(traced.graph.find_nodes(op="placeholder")) == 1
    # The graph targets the model under "model." and computes what the model does.
    targets = {n.target for n in traced.graph.find_nodes(op="call_module")}
    assert "model.blocks.0.up" in targets
    (out,) = _run(traced.root, traced.graph, x)
    torch.testing.assert_close(out, model(x))


def test_export_is_the_fallback_with_a_dynamic_batch() -> None:
    model = ShapeLoop().double()
    traced = trace(model, (torch.randn(4, 3, 4, dtype=torch.float64),))
    assert traced.method == "export"
    assert traced.device == torch.device("cpu")
    (placeholder,) = traced.graph.find_nodes(op="placeholder")
    assert isinstance(placeholder.meta["val"].shape[0], torch.SymInt)
    for batch in (1, 3, 7):  # micro-batches of any size run through the same graph
        x = torch.randn(batch, 3, 4, dtype=torch.float64)
        (out,) = _run(traced.root, traced.graph, x)
        torch.testing.assert_close(out, model(x))


def test_export_shares_the_model_state() -> None:
    model = DropoutBatchNorm()
    traced = trace(model, (torch.randn(6, 8),), method="export")
    assert traced.model is model
    bn = model.get_submodule("layers.0.1")
    assert traced.root.get_buffer("model.layers.0.1.running_mean") is bn.running_mean
    assert traced.root.get_parameter("model.layers.0.1.weight") is bn.weight


class _Typed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(x, torch.Tensor):  # False for an fx proxy: fx traces the wrong branch
            x = x * 2
        return self.linear(x)


def test_a_wrong_fx_trace_is_caught_and_export_used() -> None:
    model = _Typed()
    x = torch.randn(3, 4)
    traced = trace(model, (x,))
    assert traced.method == "export"
    (out,) = _run(traced.root, traced.graph, x)
    torch.testing.assert_close(out, model(x))
    with pytest.raises(TracingError, match="does not compute the model's outputs"):
        trace(model, (x,), method="fx")


def test_forced_fx_reports_where_it_failed() -> None:
    with pytest.raises(TracingError, match=r"torch\.fx failed in blocks\.0 \(LoopBlock\)"):
        trace(ShapeLoop(), (torch.randn(4, 3, 4),), method="fx")


def test_untraceable_model_gets_a_one_line_error_with_the_fix() -> None:
    with pytest.raises(TracingError) as info:
        trace(DataDependent(), (torch.randn(4, 4),))
    message = str(info.value)
    assert "\n" not in message
    assert "torch.fx failed in gate (Gate)" in message
    assert "torch.export (non-strict) failed" in message
    assert "leaf_modules=['gate']" in message


@pytest.mark.parametrize("leaf", ["gate", Gate])
def test_leaf_modules_make_a_submodule_opaque(leaf: str | type[nn.Module]) -> None:
    model = DataDependent()
    traced = trace(model, (torch.randn(4, 4),), leaf_modules=[leaf])
    assert traced.method == "fx"
    assert "model.gate" in {n.target for n in traced.graph.find_nodes(op="call_module")}


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match="method"):
        trace(ResidualMLP(), (torch.randn(2, 5),), method="jit")


def test_keyword_inputs_and_constants() -> None:
    model = KeywordModel()
    x, mask = torch.randn(5, 4), torch.rand(5)
    traced = trace(model, (x,), {"mask": mask, "scale": 2.0})
    assert len(traced.graph.find_nodes(op="placeholder")) == 2
    assert [traced.inputs.label(i) for i in range(2)] == ["args[0]", "kwargs['mask']"]
    # The constant output leaf is kept out of the graph and put back on rebuild.
    assert traced.outputs.leaves[traced.outputs.labels.index("['scale']")] == 2.0
    outs = _run(traced.root, traced.graph, x, mask)
    rebuilt = traced.outputs.rebuild(outs)
    expected = model(x, mask=mask, scale=2.0)
    assert rebuilt["scale"] == 2.0 and isinstance(rebuilt["hidden"], tuple)
    torch.testing.assert_close(rebuilt["logits"], expected["logits"])
    with pytest.raises(ValueError, match="baked into the graph"):
        traced.inputs.flatten(((x,), {"mask": mask, "scale": 3.0}), "inputs")


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ((torch.tensor(1.0),), "0-d tensor"),
        ((torch.randn(3, 5), torch.randn(4, 5)), "dim-0 sizes differ"),
        ((3,), "contain no tensor"),
    ],
)
def test_inputs_must_be_batch_major(inputs: tuple[object, ...], match: str) -> None:
    class Add(nn.Module):
        def forward(self, *xs: object) -> object:
            return xs[0]

    with pytest.raises(ValueError, match=match):
        trace(Add(), inputs)


class _Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).mean()


class _Pool(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sum(0)


@pytest.mark.parametrize(("model", "match"), [(_Loss(), "0-d tensor"), (_Pool(), "rows along")])
def test_outputs_must_be_batch_major(model: nn.Module, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        trace(model, (torch.randn(3, 4),))


def test_export_refuses_a_hard_coded_batch() -> None:
    class Fixed(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + torch.ones(4, 2)  # only broadcasts for a batch of 4

    with pytest.raises(TracingError, match="batch size"):
        trace(Fixed(), (torch.randn(4, 2),), method="export")


def test_export_checks_that_outputs_follow_the_batch() -> None:
    class Fixed(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.mean() * torch.ones(4, 2)  # 4 rows whatever the batch

    with pytest.raises(ValueError, match="batch along dim 0"):
        trace(Fixed(), (torch.randn(4, 2),), method="export")


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tracing_leaves_the_model_untouched(method: str) -> None:
    torch.manual_seed(0)
    model = DropoutBatchNorm(p=0.5)
    model.layers[1].eval()  # a mixed mode must survive too
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    modes = [m.training for m in model.modules()]
    x = torch.randn(6, 8)
    rng = torch.get_rng_state()
    trace(model, (x,), method=method)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name


class _Steps(nn.Module):
    """Counts its calls with ``+=`` on a buffer, which torch.fx's trace turns into an
    assignment of a proxy to the attribute (and an add the graph does not write back)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        self.steps += 1
        return self.linear(x) * 2


def test_an_attribute_assigned_while_traced_stays_the_model_s() -> None:
    model = _Steps()
    steps = model.steps
    # fx's graph misses the update (its check says so); export's records it.
    with pytest.raises(TracingError, match="buffer updates"):
        trace(model, (torch.randn(3, 4),), method="fx")
    assert model.steps is steps  # not a proxy: the model still runs, export traces it
    traced = trace(model, (torch.randn(3, 4),))
    assert traced.method == "export" and model.steps is steps and steps.item() == 0
    model(torch.randn(3, 4))
    assert steps.item() == 1


def test_what_the_model_sets_while_traced_is_put_back_but_its_marks_stay() -> None:
    class Keeps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.last: Tensor | None = None
            self.calls = 0

        def forward(self, x: Tensor) -> Tensor:
            for _ in range(x.shape[1]):  # torch.fx cannot range over a proxy: export traces
                x = x + 0.0
            self.last, self.calls = x.detach(), self.calls + 1
            self.seen = x.detach()  # added: a fake tensor under export
            if not getattr(self, "hooked", False):  # a library's mark of work done once
                self.hooked = True
            return self.linear(x)

    model = Keeps()
    traced = trace(model, (torch.randn(3, 4),))
    assert traced.method == "export"
    assert model.last is None and model.calls == 0  # no fake tensor left, nothing counted
    seen = getattr(model, "seen", None)
    assert seen is None or type(seen) is Tensor  # not a fake tensor
    assert model.hooked is True


def test_model_mode_restores_each_module() -> None:
    model = DropoutBatchNorm()
    model.drop.eval()
    with model_mode(model, False):
        assert not any(m.training for m in model.modules())
    assert model.training and not model.drop.training


def test_mode_dependent_code_traces_differently() -> None:
    model = DropoutBatchNorm(p=0.5)
    x = torch.randn(6, 8)
    train = trace(model, (x,))
    with model_mode(model, False):
        evaluation = trace(model, (x,))
    # F.dropout(x, p, self.training) bakes the mode into the graph.
    assert train.code() != evaluation.code()
    assert not evaluation.training


def _tiny_llama() -> nn.Module:
    """A Hugging Face Llama with its default config, the cache on, and tiny sizes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM(config)


def test_hugging_face_models_are_traced_without_their_cache() -> None:
    model = _tiny_llama()
    assert model.config.use_cache
    traced = trace(model, (torch.randint(0, 50, (4, 8)),))
    assert traced.outputs.labels == ["['logits']"]  # no past_key_values
    assert model.config.use_cache  # the model is left as it was


def test_float64_grouped_gemm_experts_are_refused_with_the_fix_that_works() -> None:
    """Mixtral's default experts kernel (torch._grouped_mm) has no float64; the fix named
    (batched-matmul experts) traces into many units, not one leaf."""
    from tests.support.hf_models import mixtral

    model, args, _ = mixtral()
    model.double()
    with pytest.raises(TracingError) as raised:
        trace(model, args)
    message = str(raised.value)
    assert "Fix: the experts of MixtralExperts (model.layers.0.mlp.experts, " in message
    assert "model.set_experts_implementation('batched_mm')" in message
    model.set_experts_implementation("batched_mm")
    units, flat = unit_sequential(model, args)
    assert len(units) == 6  # embedding, rotary embedding, two decoder layers, norm, head
    (logits,) = units(*flat)
    torch.testing.assert_close(logits, model(*args).logits)


def test_a_cache_asked_for_is_refused_with_the_fix() -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 50, (4, 8))
    with pytest.raises(TracingError, match=r"Cache.*Fix: pass use_cache=False"):
        trace(model, (ids,), {"use_cache": True})
