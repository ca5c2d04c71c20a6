"""The identity and size of the memory block behind a tensor."""

from __future__ import annotations

from torch import Tensor

__all__: list[str] = []


def storage_key(tensor: Tensor) -> tuple[int, int]:
    """(identity, bytes) of the memory block behind a tensor.

    The identity is the storage object's own, not its data pointer: every storage on the
    meta device has data pointer 0, and shapes-only counting must still tell them apart.
    """
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError):
        # Tensors without a plain storage (sparse, some subclasses): count them as they are.
        return id(tensor), tensor.numel() * tensor.element_size()
