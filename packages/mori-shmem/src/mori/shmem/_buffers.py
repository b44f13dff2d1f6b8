"""Turning Python data (bytes, buffers, numpy arrays, torch tensors) into (address, size) pairs.

torch is never imported here: a tensor is recognised by its ``data_ptr``/``element_size``
methods, so mori.shmem works without it installed.
"""

from __future__ import annotations

from typing import Any

from mori.core.memory import buffer_span

__all__ = ["as_span"]

_tensor_types: dict[type, bool] = {}  # type -> whether it is torch's tensor (types are few: asked once each)


def as_span(obj: Any, what: str, writable: bool) -> tuple[int, int, bool]:
    """``(address, size in bytes, on a GPU)`` of the memory behind ``obj``; raises
    TypeError/ValueError naming ``what`` when unusable. The caller keeps ``obj`` alive.

    Accepts a torch tensor (CPU or CUDA, contiguous), a numpy array (C-contiguous) or anything
    with the buffer protocol (bytes, bytearray, memoryview, array.array). ``writable`` rejects
    read-only objects (the destination of a get). A 4 KiB put feels every step here: a type is
    asked once whether it is torch's tensor, a buffer's span is one native call.
    """
    cls = type(obj)
    tensor = _tensor_types.get(cls)
    if tensor is None:
        tensor = cls.__module__.startswith("torch") and hasattr(cls, "data_ptr") and hasattr(cls, "element_size")
        if len(_tensor_types) < 256:
            _tensor_types[cls] = tensor
    if tensor:
        if not obj.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj.is_cuda
    try:
        addr, nbytes = buffer_span(obj, writable)
    except TypeError:
        raise TypeError(
            f"{what}: expected bytes-like data, a numpy array or a torch tensor, got {type(obj).__name__}"
        ) from None
    except ValueError as exc:
        raise ValueError(
            f"{what}: {exc} (np.ascontiguousarray makes a C-contiguous copy; a get needs a "
            "writable destination such as a bytearray)"
        ) from None
    return addr, nbytes, False
