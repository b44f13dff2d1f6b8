"""The memory behind a Python object, as an address and a size; the live blocks of a heap."""

from __future__ import annotations

from .._native.memory import LiveRanges
from .._native.memory import buffer_span as _buffer_span

__all__ = ["LiveRanges", "buffer_span"]


def buffer_span(obj: object, writable: bool = False) -> tuple[int, int]:
    """``(address, nbytes)`` of ``obj``'s memory, for anything with the buffer protocol
    (``bytes``, ``bytearray``, ``memoryview``, ``array.array``, numpy arrays, ``mmap``).

    The address is valid while ``obj`` lives and keeps its memory (a ``bytearray`` that is
    resized moves it). Raises :class:`TypeError` when ``obj`` has no buffer protocol and
    :class:`ValueError` when its buffer is not C-contiguous or, with ``writable``, read-only;
    the message names ``obj``'s type. One native call: a small transfer's own cost.
    """
    return _buffer_span(obj, writable)
