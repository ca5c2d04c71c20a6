"""Checks of the command line's inputs made before any long work: devices, profile vs model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopipe.planning import format_bytes

if TYPE_CHECKING:
    from torch import nn

    from profiler import LayerProfile, Profile

__all__: list[str] = []


def check_device(text: str, option: str = "--device") -> str:
    """The device ``text`` names, when layers can be measured on it on this machine.

    Args:
        text: a torch device string such as ``cpu``, ``cuda`` or ``cuda:1``.
        option: the option it came from, named in errors.

    Returns:
        The device as torch writes it.

    Raises:
        ValueError: ``text`` is no device, is ``meta`` (which holds no data to time), or
            names a device this machine lacks.
    """
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{option} {text!r} is not a device: use cpu, cuda or cuda:N") from None
    if device.type == "meta":
        raise ValueError(
            f"{option} {text}: meta tensors hold no data, so nothing can be timed on them; "
            "use cpu or cuda:N"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{option} {text}: CUDA is not available here; use cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{option} {text}: this machine has {count} CUDA device"
                f"{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})"
            )
    elif device.type != "cpu":
        try:  # other backends (mps, xpu, ...) say on first use whether they are usable
            torch.empty(0, device=device)
        except Exception as exc:
            message = " ".join(str(exc).split()[:12])
            raise ValueError(f"{option} {text} is not usable here ({message}); use cpu") from None
    return str(device)


def check_device_list(text: str, option: str = "--devices") -> list[str]:
    """A comma list of devices (``cuda:0,cuda:1``), each checked by :func:`check_device`."""
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"{option} lists no devices: give them as cuda:0,cuda:1 or cpu,cpu")
    if not all(parts):
        raise ValueError(f"{option} {text!r} has an empty entry: list devices as cuda:0,cuda:1")
    return [check_device(part, option) for part in parts]


def _figures(name: str, module: nn.Module) -> tuple[str, str, int, int]:
    """What a profile records of a layer: name, class, parameter and buffer bytes."""
    # As the profiler counts them: shared tensors once per layer.
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return name, type(module).__name__, params, buffers


def _describe(figures: tuple[str, str, int, int], buffers: bool) -> str:
    name, kind, params, buffer_bytes = figures
    extra = f", {format_bytes(buffer_bytes)} of buffers" if buffers else ""
    return f"{name!r} ({kind}, {format_bytes(params)} of parameters{extra})"


def _recorded(layer: LayerProfile, name: str) -> tuple[str, str, int, int]:
    """What the profile records of a layer, its name as the model spells it when they
    match (a profile saved with ``h/3`` names the layer ``h.3``)."""
    from profiler import same_layer_name

    recorded = name if same_layer_name(layer.name, name) else layer.name
    return recorded, layer.kind, layer.param_bytes, layer.buffer_bytes


def check_profile_matches(
    profile: Profile, model: nn.Sequential, profile_path: str, model_path: str
) -> None:
    """Refuses a profile of other layers than ``model``'s, naming the first that differs.

    A profile records each layer's name, class and parameter and buffer bytes; all must
    agree, or the plan would split another model's layers. Names match in either spelling
    of a unit's module path (``h.3``, or ``h/3`` as older profiles wrote it).

    Raises:
        ValueError: the layer counts or one layer's figures differ.
    """
    fix = (
        f"pass the model file the profile was made from, or profile {model_path} again "
        f"(autopipe profile {model_path} -o {profile_path})"
    )
    if len(model) != len(profile):
        raise ValueError(
            f"{profile_path} does not match {model_path}: the profile has {len(profile)} "
            f"layers, the model {len(model)}; {fix}"
        )
    from profiler import layer_names

    named = zip(profile.layers, layer_names(model), model.children(), strict=True)
    for index, (layer, name, module) in enumerate(named):
        recorded, found = _recorded(layer, name), _figures(name, module)
        if recorded != found:
            buffers = recorded[:3] == found[:3]  # only the buffers differ: name them
            raise ValueError(
                f"{profile_path} does not match {model_path}: layer {index} is "
                f"{_describe(recorded, buffers)} in the profile but "
                f"{_describe(found, buffers)} in the model; {fix}"
            )
