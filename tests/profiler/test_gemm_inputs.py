"""The saved activations of weight GEMMs, derived by hand from the layers' shapes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from profiler.counting import count_layer, meta_copy
from profiler.measure import profile_layers
from profiler.profile import Profile
from tests.support.counted import counted_and_measured

CPU = torch.device("cpu")


def _gemm_saved(layer: nn.Module, x: Tensor, autocast: str | None = None) -> tuple[int, int]:
    """(saved, gemm_saved) of one layer counted on fake tensors."""
    counts, _, _ = count_layer(meta_copy(layer), (x.to("meta"),), CPU, autocast=autocast)
    return counts.saved, counts.gemm_saved


def _stack(a: int = 8, b: int = 16, c: int = 12, d: int = 4) -> nn.Sequential:
    return nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Linear(b, c), nn.ReLU(), nn.Linear(c, d))


def test_a_stack_of_linear_layers_saves_the_inputs_only_they_save() -> None:
    n, a, b, c = 5, 8, 16, 12
    saved, gemm = _gemm_saved(_stack(a, b, c), torch.empty(n, a))
    # x (first GEMM), GELU's input, GELU's output (second GEMM), ReLU's output (which ReLU
    # keeps for its backward, so the third GEMM's input stays in the model's dtype).
    assert saved == 4 * n * (a + b + b + c)
    assert gemm == 4 * n * (a + b)


def test_under_autocast_the_gemm_inputs_are_the_half_precision_copies() -> None:
    n, a, b, c = 5, 8, 16, 12
    _, gemm = _gemm_saved(_stack(a, b, c), torch.empty(n, a), "bfloat16")
    assert gemm == 2 * n * (a + b)


def test_an_input_of_several_gemms_counts_once() -> None:
    class _Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = nn.Linear(8, 4), nn.Linear(8, 4)

        def forward(self, x: Tensor) -> Tensor:
            return self.q(x) + self.k(x)

    saved, gemm = _gemm_saved(_Fork(), torch.empty(3, 8))
    assert saved == gemm == 4 * 3 * 8


def test_products_of_two_activations_are_no_weight_gemms() -> None:
    class _Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x: Tensor) -> Tensor:
            h = self.proj(x)
            return h @ h.transpose(-1, -2)

    saved, gemm = _gemm_saved(_Scores(), torch.empty(2, 3, 6))
    assert gemm == 4 * 2 * 3 * 6  # x; h is saved by the activations' product
    assert saved == gemm + 4 * 2 * 3 * 6


class _LlamaBlock(nn.Module):
    """One Llama decoder layer with its rotary embedding, on hidden states."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        from transformers.models.llama import modeling_llama

        config = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=1, vocab_size=50,
        )  # fmt: skip
        self.layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        embeddings = self.rotary(x, positions)
        out = self.layer(x, position_embeddings=embeddings)
        return out[0] if isinstance(out, tuple) else out


def test_a_llama_block_saves_four_gemm_inputs() -> None:
    batch, seq, hidden, inter = 2, 8, 32, 48
    tokens = batch * seq
    _, gemm = _gemm_saved(_LlamaBlock(), torch.empty(batch, seq, hidden))
    # The normed input of q/k/v, attention's output into o_proj, the normed input of
    # gate/up, and silu(gate)·up into down_proj; in float32.
    assert gemm == 4 * tokens * (3 * hidden + inter)


@pytest.mark.parametrize("case", ["stack", "layers", "llama"])
def test_counted_gemm_inputs_equal_measured_ones(case: str) -> None:
    torch.manual_seed(0)
    if case == "stack":
        layers: list[nn.Module] = [_stack()]
        sample = torch.randn(4, 8)
    elif case == "layers":
        layers = list(_stack())
        sample = torch.randn(4, 8)
    else:
        layers = [_LlamaBlock()]
        sample = torch.randn(2, 8, 32)
    counted, measured = counted_and_measured(layers, sample, batch_sizes=[2, 4])
    for ours, theirs in zip(counted.layers, measured.layers, strict=True):
        assert ours.gemm_saved == theirs.gemm_saved
        assert ours.gemm_saved is not None
        assert any(ours.gemm_saved) == (ours.kind not in ("GELU", "ReLU"))


def test_the_figure_round_trips_and_older_profiles_lack_it() -> None:
    profile = profile_layers([_stack()], torch.randn(4, 8), batch_sizes=[4], measure=False)
    again = Profile.from_dict(profile.to_dict())
    assert again.layers[0].gemm_saved == profile.layers[0].gemm_saved == [4 * 4 * (8 + 16)]
    older = profile.to_dict()
    del older["layers"][0]["gemm_saved"]
    assert Profile.from_dict(older).layers[0].gemm_saved is None


def test_more_gemm_inputs_than_saved_bytes_are_refused() -> None:
    profile = profile_layers([_stack()], torch.randn(4, 8), batch_sizes=[4], measure=False)
    data = profile.to_dict()
    data["layers"][0]["gemm_saved"] = [data["layers"][0]["saved"][0] + 1]
    with pytest.raises(ValueError, match="gemm_saved"):
        Profile.from_dict(data)
    data["layers"][0]["gemm_saved"] = [1, 2]
    with pytest.raises(ValueError, match="gemm_saved"):
        Profile.from_dict(data)
