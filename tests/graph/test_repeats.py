"""A deep stack of alike blocks traced once: the extended graph is the whole export's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
from torch import Tensor, nn

import autopipe.graph.tracing as tracing
from autopipe.graph.repeats import MIN_BLOCKS, Repeats, find_repeats
from autopipe.graph.sequential import unit_sequential

transformers = pytest.importorskip("transformers")


def _llama(layers: int) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,  # four query heads per key: an attribute equal to index 4
        vocab_size=50,
        use_cache=False,
    )
    return transformers.LlamaForCausalLM(config).double()


def _operations(units: nn.Module) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """Each unit's nodes by operation and target (parameters by their last name)."""
    found = []
    for name, unit in units.named_children():
        graph = next(iter(unit.graphs.values())).graph
        ops = [
            (n.op, str(n.target).rsplit(".", 1)[-1] if n.op == "get_attr" else str(n.target))
            for n in graph.nodes
            if n.op != "placeholder"
        ]
        found.append((name, ops))
    return found


def _watch_extend(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each extension of a cut graph returns, appended as it happens."""
    extended: list[bool] = []
    real_extend = tracing.extend

    def watched(*args: Any) -> bool:
        extended.append(real_extend(*args))
        return extended[-1]

    monkeypatch.setattr(tracing, "extend", watched)
    return extended


def _train(units: nn.Module, flat: tuple[Tensor, ...], model: nn.Module) -> Tensor:
    model.zero_grad()
    value: Any = flat
    for unit in units:
        value = unit(*value)
    value[0].sum().backward()
    return value[0].detach()


def test_alike_blocks_are_exported_once_and_repeated(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama(10)
    assert find_repeats(model) == Repeats("model.layers", 10, 0)
    ids = torch.randint(0, 50, (2, 8))
    extended = _watch_extend(monkeypatch)
    units, flat = unit_sequential(model, ids, both_modes=False)
    assert extended == [True]
    out = _train(units, flat, model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    # The whole model exported: the same units, operations, outputs and gradients.
    monkeypatch.setattr(tracing, "find_repeats", lambda model: None)
    whole, flat_whole = unit_sequential(model, ids, both_modes=False)
    assert _operations(units) == _operations(whole)
    assert [n for n, _ in units.named_children()][2:12] == [f"model/layers/{i}" for i in range(10)]
    assert torch.equal(out, _train(whole, flat_whole, model))
    for name, p in model.named_parameters():
        assert torch.equal(grads[name], p.grad), name
    assert torch.equal(out, model(ids).logits.detach())


class Block(nn.Module):
    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.linear(x)) * self.scale + x


class Stack(nn.Module):
    """Blocks whose first ones differ by an attribute; optionally a tail reading them all."""

    def __init__(self, count: int, differing: int = 0, every_output: bool = False) -> None:
        super().__init__()
        scales = [0.5] * differing + [1.0] * (count - differing)
        self.blocks = nn.ModuleList(Block(4, s) for s in scales)
        self.every_output = every_output

    def forward(self, x: Tensor) -> Tensor:
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return torch.stack(outputs).sum(0) if self.every_output else x


def test_the_alike_suffix_is_found_by_every_attribute() -> None:
    assert find_repeats(Stack(MIN_BLOCKS - 1)) is None  # too few to cut
    assert find_repeats(Stack(12, differing=2)) == Repeats("blocks", 12, 2)
    assert find_repeats(Stack(12, differing=9)) is None  # three alike: nothing to repeat


@pytest.mark.parametrize("every_output", [False, True])
def test_a_tail_reading_earlier_blocks_is_exported_whole(
    every_output: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fx traces this model; export is asked for to reach the repeats.
    model = Stack(12, differing=2, every_output=every_output).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    extended = _watch_extend(monkeypatch)
    traced = tracing.trace(model, (x,), method="export")
    assert extended == [not every_output]
    (out,) = fx.GraphModule(traced.root, traced.graph)(x)
    assert torch.equal(out, model(x))
