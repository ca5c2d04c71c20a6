"""Tests of the command line's up-front checks (autopipe.cli.checks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopipe.cli.checks import check_device, check_device_list, check_profile_matches
from profiler.profile import LayerProfile, Profile


def test_devices_this_machine_has() -> None:
    assert check_device("cpu") == "cpu"
    assert check_device_list(" cpu , cpu:0 ") == ["cpu", "cpu:0"]


def test_cuda_index_beyond_the_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert check_device("cuda:1") == "cuda:1" and check_device("cuda") == "cuda"
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA devices"):
        check_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available here; use cpu"):
        check_device("cuda:0")


def test_an_unusable_backend_is_named() -> None:
    if torch.backends.mps.is_available():
        pytest.skip("this machine can use mps")
    with pytest.raises(ValueError, match=r"--devices mps is not usable here \("):
        check_device("mps", "--devices")


def _profile(model: nn.Sequential, names: list[str] | None = None) -> Profile:
    layers = [
        LayerProfile(
            name=(names or [name for name, _ in model.named_children()])[i],
            kind=type(child).__name__,
            forward=[1e-3],
            backward=[1e-3],
            saved=[0],
            output=[0],
            param_bytes=sum(p.numel() * p.element_size() for p in child.parameters()),
            buffer_bytes=sum(b.numel() * b.element_size() for b in child.buffers()),
        )
        for i, child in enumerate(model.children())
    ]
    return Profile(layers=layers, batch_sizes=[2], input=[0], batch_size=8)


def test_profile_of_the_model_matches() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    check_profile_matches(_profile(model), model, "p.json", "m.py")


@pytest.mark.parametrize(
    ("other", "names", "expected"),
    [
        (nn.Sequential(nn.Linear(4, 4)), None, "the profile has 2 layers, the model 1"),
        (
            nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
            None,
            "layer 1 is '1' (BatchNorm1d, 32 B of parameters) in the profile but '1' "
            "(LayerNorm, 32 B of parameters) in the model",
        ),
        (
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)),
            None,
            "'1' (BatchNorm1d, 32 B of parameters, 40 B of buffers) in the profile but '1' "
            "(BatchNorm1d, 32 B of parameters, 0 B of buffers)",
        ),
        (
            nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
            ["embed", "norm"],
            "layer 0 is 'embed' (Linear, 80 B of parameters) in the profile but '0'",
        ),
    ],
)
def test_profile_of_another_model(
    other: nn.Sequential, names: list[str] | None, expected: str
) -> None:
    recorded = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError) as info:
        check_profile_matches(_profile(recorded, names), other, "p.json", "m.py")
    message = str(info.value)
    assert message.startswith("p.json does not match m.py: ") and expected in message
    assert message.endswith("or profile m.py again (autopipe profile m.py -o p.json)")
