"""Turning Python data (bytes, buffers, numpy arrays, torch tensors) into (address, size) pairs.

torch is never imported here: a tensor is recognised by its ``data_ptr``/``element_size``
methods, so mori.shmem works without it installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mori.core.memory import buffer_span

__all__ = ["Span", "as_span"]


@dataclass(slots=True)
class Span:
    """A contiguous range of memory some Python object owns (``keep`` keeps it alive)."""

    addr: int
    nbytes: int
    on_gpu: bool
    keep: Any


_tensor_types: dict[type, bool] = {}  # type -> whether it is torch's tensor (types are few: asked once each)


def _is_tensor_type(cls: type) -> bool:
    """Whether objects of ``cls`` are torch tensors (looked up, not recomputed: a small put feels it)."""
    known = _tensor_types.get(cls)
    if known is None:
        known = cls.__module__.startswith("torch") and hasattr(cls, "data_ptr") and hasattr(cls, "element_size")
        if len(_tensor_types) < 256:
            _tensor_types[cls] = known
    return known


def as_span(obj: Any, what: str, writable: bool) -> Span:
    """The memory behind ``obj``; raises TypeError/ValueError naming ``what`` when unusable.

    Accepts a torch tensor (CPU or CUDA, contiguous), a numpy array (C-contiguous) or anything
    with the buffer protocol (bytes, bytearray, memoryview, array.array). ``writable`` rejects
    read-only objects (the destination of a get).
    """
    if _is_tensor_type(type(obj)):
        if not obj.is_contiguous():
            raise ValueError(f"{what}: tensor must be contiguous (call .contiguous() first)")
        return Span(int(obj.data_ptr()), int(obj.numel()) * int(obj.element_size()), bool(obj.is_cuda), obj)
    try:
        addr, nbytes = buffer_span(obj, writable)  # one native call: a 4 KiB put feels every step here
    except TypeError:
        raise TypeError(f"{what}: expected bytes-like data, a numpy array or a torch tensor, "
                        f"got {type(obj).__name__}") from None
    except ValueError as exc:
        raise ValueError(f"{what}: {exc} (np.ascontiguousarray makes a C-contiguous copy; a get needs a "
                         "writable destination such as a bytearray)") from None
    return Span(addr, nbytes, False, obj)
