"""``--sequence S``: the model file's sample rebuilt at S tokens before it is counted.

A model file's sample fixes what the profile counts: FLOPs and bytes of one mini-batch at
the sample's sequence length. ``--sequence S`` sets that length, so one model file plans
every length it is trained at (attention's FLOPs grow as S², the rest as S). The sample
must be integer token ids of shape (batch, sequence); every other input whose dim 1 is the
same length (an attention mask, position ids) is rebuilt with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from autopipe import ModelFileError
from autopipe.cli.model_file import LoadedModel

__all__: list[str] = []  # internal to the command line


def _resized(tensor: Tensor, length: int) -> Tensor:
    """``tensor`` with dim 1 cut or grown to ``length``: grown by repeating its last
    position, so that a mask stays a mask and token ids stay in the vocabulary."""
    if length <= tensor.shape[1]:
        return tensor[:, :length].contiguous()
    extra = list(tensor.shape)
    extra[1] = length - tensor.shape[1]
    return torch.cat([tensor, tensor[:, -1:].expand(extra)], dim=1)


def _position_limit(loaded: LoadedModel) -> int | None:
    """The model config's ``max_position_embeddings``, where it has one."""
    limit = getattr(getattr(loaded.model, "config", None), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def at_sequence(loaded: LoadedModel, length: int) -> LoadedModel:
    """The model file's model with its sample (and kwargs) at ``length`` tokens.

    Args:
        loaded: the model file, as loaded.
        length: tokens per sample, ``--sequence``.

    Returns:
        ``loaded`` with every tensor input whose dim 1 is the sample's sequence length
        rebuilt at ``length`` (the same object where the length is already ``length``).

    Raises:
        ModelFileError: the sample is not integer token ids of shape (batch, sequence), or
            ``length`` exceeds the model config's ``max_position_embeddings``.
    """
    tensors = (loaded.sample,) if isinstance(loaded.sample, Tensor) else loaded.sample
    first = tensors[0]
    if first.dim() != 2 or first.dtype.is_floating_point or first.dtype.is_complex:
        kind = f"{first.dtype} of shape {tuple(first.shape)}"
        raise ModelFileError(
            f"--sequence {length}: the sample of {loaded.path} ({kind}) is not token ids of "
            "shape (batch, sequence); leave out --sequence and set the length in `sample`"
        )
    limit = _position_limit(loaded)
    if limit is not None and length > limit:
        raise ModelFileError(
            f"--sequence {length} exceeds the model's max_position_embeddings {limit}: give "
            f"at most {limit}, or raise max_position_embeddings in the model's config"
        )
    current = int(first.shape[1])
    if length == current:
        return loaded

    def rebuilt(value: Any) -> Any:
        if isinstance(value, Tensor) and value.dim() >= 2 and int(value.shape[1]) == current:
            return _resized(value, length)
        return value

    sample = (
        rebuilt(loaded.sample)
        if isinstance(loaded.sample, Tensor)
        else tuple(rebuilt(t) for t in loaded.sample)
    )
    kwargs = {key: rebuilt(value) for key, value in loaded.kwargs.items()}
    return replace(loaded, sample=sample, kwargs=kwargs)
