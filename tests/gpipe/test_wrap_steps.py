"""``wrap`` through the build path: settings or keywords, refused keywords and schedules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe import wrap
from autopipe.planning.pipeline_settings import PipelineSettings


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def test_settings_and_keywords_wrap_alike() -> None:
    x = torch.randn(8, 4, dtype=torch.float64)
    torch.manual_seed(0)
    first = _Residual().double()
    second = _Residual().double()
    second.load_state_dict(first.state_dict())
    by_keywords = wrap(first, (x,), stages=2, chunks=2, strategy="uniform")
    settings = PipelineSettings(chunks=2, strategy="uniform")
    by_settings = wrap(second, (x,), settings, stages=2)
    for wrapped in (by_keywords, by_settings):
        assert (wrapped.plan.balance, wrapped.plan.chunks) == ([2, 2], 2)
        assert wrapped.plan.checkpoint == "except_last"  # the rule's, for GPipe
    # float64 and the same weights: the same outputs, bit for bit.
    assert torch.equal(by_keywords(x), by_settings(x))


def test_unknown_keyword_is_refused_before_tracing() -> None:
    with pytest.raises(TypeError, match=r"^wrap\(\) got an unexpected keyword argument 'chunk';"):
        wrap(_Residual(), (torch.randn(8, 4),), chunk=2)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({"schedule": "1f1b"}, "wrap\\(\\) runs GPipe's schedule, not '1f1b'"),
        ({"virtual_stages": 2}, "one stage per device"),
        ({"data_parallel": 2}, "one stage per device"),
        ({"tensor_parallel": 2}, "runs each stage on one device; leave out tensor_parallel="),
    ],
)
def test_what_gpipe_does_not_run_is_refused(given: dict[str, object], expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        wrap(_Residual(), (torch.randn(8, 4),), PipelineSettings(**given))  # type: ignore[arg-type]
