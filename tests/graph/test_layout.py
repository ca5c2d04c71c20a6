"""Units of a model whose layers all read one parameter: one unit per layer, the tensor shared."""

from __future__ import annotations

import pytest
import torch

from autopipe.graph.layout import Layout
from autopipe.graph.sharing import SharedState
from tests.support.graph_support import layout_of
from tests.support.wrap_models import SharedBias


def _holders(layout: Layout, tensor: torch.Tensor) -> list[int]:
    """The units whose modules hold ``tensor`` itself (no copy) among their parameters."""
    units = layout.modules()
    return [k for k, unit in enumerate(units) if any(p is tensor for p in unit.parameters())]


@pytest.mark.parametrize("method", ["fx", "export"])
def test_a_parameter_every_block_reads_leaves_one_unit_per_block(method: str) -> None:
    model = SharedBias()
    layout = layout_of(model, torch.randn(3, 8), method=method)
    assert layout.names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert layout.merged == []
    assert layout.shared == [SharedState("bias", (0, 1, 2, 3))]
    assert "bias" not in layout.written
    assert _holders(layout, model.bias) == [0, 1, 2, 3]


def test_a_parameter_written_in_place_still_merges_its_readers() -> None:
    layout = layout_of(SharedBias(clamp=True), torch.randn(3, 8), method="fx")
    assert layout.names == ["blocks.0+blocks.1+blocks.2+blocks.3"]
    assert "bias" in layout.written
    assert layout.merged[0] == "blocks.0 | blocks.1: both sides use bias, which is written in place"


def test_deberta_v2_splits_into_its_layers() -> None:
    pytest.importorskip("transformers")
    from tests.support.hf_models import deberta_v2

    model, args, _ = deberta_v2()
    layout = layout_of(model, *args, both_modes=False)
    layers = [f"encoder.layer.{i}" for i in range(4)]
    assert layout.names == ["embeddings", *layers] and layout.merged == []
    assert layout.shared == [SharedState("encoder.rel_embeddings.weight", (1, 2, 3, 4))]
    assert not layout.written
    assert _holders(layout, model.encoder.rel_embeddings.weight) == [1, 2, 3, 4]
