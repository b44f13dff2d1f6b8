"""Turning Python data (bytes, buffers, numpy arrays, torch tensors) into (address, size) pairs.

torch is never imported here: a tensor is recognised by its ``data_ptr``/``element_size``
methods, so mori.shmem works without it installed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Span", "as_span"]


@dataclass(slots=True)
class Span:
    """A contiguous range of memory some Python object owns (``keep`` keeps it alive)."""

    addr: int
    nbytes: int
    on_gpu: bool
    keep: Any


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "element_size")


def as_span(obj: Any, what: str, writable: bool) -> Span:
    """The memory behind ``obj``; raises TypeError/ValueError naming ``what`` when unusable.

    Accepts a torch tensor (CPU or CUDA, contiguous), a numpy array (C-contiguous) or anything
    with the buffer protocol (bytes, bytearray, memoryview, array.array). ``writable`` rejects
    read-only objects (the destination of a get).
    """
    if isinstance(obj, np.ndarray):  # first: the cheapest test, on the commonest argument
        arr = obj
    elif _is_tensor(obj):
        if not obj.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        return Span(int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), bool(obj.is_cuda), obj)
    else:
        try:
            arr = np.frombuffer(memoryview(obj).cast("B"), dtype=np.uint8)
        except TypeError:
            raise TypeError(f"{what}: expected bytes-like data, a numpy array or a torch tensor, "
                            f"got {type(obj).__name__}") from None
        except ValueError:
            raise ValueError(f"{what}: buffer must be C-contiguous") from None
        if writable and memoryview(obj).readonly:
            raise ValueError(f"{what}: buffer is read-only ({type(obj).__name__}); pass a bytearray or array")
    flags = arr.flags
    if not flags.c_contiguous:
        raise ValueError(f"{what}: array must be C-contiguous (np.ascontiguousarray)")
    if flags.writeable and arr.nbytes:
        # A quarter of the cost of arr.ctypes.data, which a small put feels (the ctypes view is
        # released at once: it holds the buffer only while the address is read).
        return Span(ctypes.addressof(ctypes.c_char.from_buffer(arr)), arr.nbytes, False, arr)  # type: ignore[arg-type]
    if writable and not flags.writeable:
        raise ValueError(f"{what}: array is read-only")
    return Span(int(arr.ctypes.data), int(arr.nbytes), False, arr)
