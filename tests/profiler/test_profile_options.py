"""``ProfileOptions``: profile_layers' options as one value, keywords laid over it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from profiler.measure import profile_layers
from profiler.profile_options import ProfileOptions, with_options


def test_options_and_keywords_profile_alike() -> None:
    layers = [nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)]
    x = torch.randn(8, 4)
    keywords = profile_layers(layers, x, chunks=2, batch_sizes=[4], names=["a", "b", "c"],
                              measure=False)  # fmt: skip
    options = ProfileOptions(chunks=2, batch_sizes=[4], measure=False)
    given = profile_layers(layers, x, options, names=["a", "b", "c"])
    assert keywords.to_dict() == given.to_dict()
    assert given.names == ["a", "b", "c"] and given.chunks == 2


def test_unknown_keyword_is_refused_in_one_line() -> None:
    with pytest.raises(TypeError) as caught:
        profile_layers([nn.ReLU()], torch.randn(2, 2), repeat=3)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("profile_layers() got an unexpected keyword argument 'repeat'")
    assert "repeats" in message
    with pytest.raises(TypeError, match="takes options=ProfileOptions"):
        with_options({"chunks": 2}, {}, "profile_layers")  # type: ignore[arg-type]
