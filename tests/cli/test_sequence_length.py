"""``--sequence S`` rebuilds the model file's sample at S tokens before counting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli_support import (
    LLAMA_FFN,
    LLAMA_HEADS,
    LLAMA_HIDDEN,
    LLAMA_KV_HEADS,
    ON_TARGET,
    assert_error,
    counted_profiles,
    llama_file,
    run,
)


def test_counts_grow_as_the_hand_count_says(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    path = llama_file(tmp_path)
    hidden, ffn = LLAMA_HIDDEN, LLAMA_FFN
    kv = hidden * LLAMA_KV_HEADS // LLAMA_HEADS
    weights = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn  # q, o; k, v; MLP
    for length in (16, 32):
        made = counted_profiles(capsys, monkeypatch, path, "--sequence", str(length))
        block = next(layer for layer in made[-1].layers if layer.name == "model.layers.0")
        assert block.flops is not None and block.shards is not None
        # One sample (batch size 1): scores and weighted sum, 2·S²·hidden each (the s² part).
        attention = 4 * length * length * hidden
        assert block.shards.attention_flops[0] == attention
        assert block.flops[0] - attention == 2 * length * weights  # the linear part, as S


def test_refuses_a_length_past_the_position_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    argv = ["plan", str(llama_file(tmp_path)), *ON_TARGET]
    expected = "--sequence 64 exceeds the model's max_position_embeddings 32: give at most 32"
    assert_error(*run(capsys, *argv, "--sequence", "64"), expected)


def test_refuses_a_sample_without_a_sequence(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "mlp.py"
    path.write_text(
        "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())\n"
        "sample = torch.randn(8, 4)\n"
    )
    argv = ["plan", str(path), *ON_TARGET]
    expected = "is not token ids of shape (batch, sequence); leave out --sequence"
    assert_error(*run(capsys, *argv, "--sequence", "16"), expected)


def test_inputs_of_the_samples_length_are_rebuilt_with_it(tmp_path: Path) -> None:
    import torch

    from autopipe.cli.model_file import LoadedModel
    from autopipe.cli.sequence_length import at_sequence

    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    loaded = LoadedModel(tmp_path, torch.nn.Identity(), ids, None, {"mask": mask, "n": 3})  # type: ignore[arg-type]
    longer = at_sequence(loaded, 5)
    assert longer.sample.tolist() == [[3, 4, 5, 5, 5], [6, 7, 8, 8, 8]]  # type: ignore[union-attr]
    assert longer.kwargs == {"mask": longer.kwargs["mask"], "n": 3}
    assert longer.kwargs["mask"].tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    shorter = at_sequence(loaded, 2)
    assert shorter.sample.tolist() == [[3, 4], [6, 7]]  # type: ignore[union-attr]
    assert at_sequence(loaded, 3) is loaded
