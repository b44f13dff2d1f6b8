"""Host atomics on raw addresses, for memory several processes map (``HostSegment``).

Every operation is sequentially consistent (C++ ``__atomic_*`` with ``seq_cst``) on an aligned
32- or 64-bit word given by its address. Values may be given signed or unsigned; they are
stored as two's complement words of ``width`` bits. Results come back unsigned unless
``signed=True``. Bad input (null or misaligned address, width other than 32/64, a value that
does not fit) raises :class:`ValueError` and touches nothing.

``wait_until`` blocks without holding the GIL, so other Python threads of the process run while
it waits, and always gives up after ``timeout`` seconds with :class:`TimeoutError`.

Example::

    seg = HostSegment.create(4096)
    atomics.fetch_add(seg.addr, 1)          # -> 0
    atomics.wait_until(seg.addr, "ge", 1, timeout=5.0)
"""

from __future__ import annotations

from ._native import atomics as _atomics
from .codes import Cmp

__all__ = [
    "fetch_add",
    "fetch_and",
    "fetch_or",
    "fetch_xor",
    "compare_swap",
    "swap",
    "load",
    "store",
    "wait_until",
]


def _check_width(width: int) -> None:
    if width not in (32, 64) or isinstance(width, bool):
        raise ValueError(f"atomic width must be 32 or 64 bits, got {width!r}")


def _word(value: int, width: int, what: str) -> int:
    """``value`` as an unsigned ``width``-bit word; accepts the signed and unsigned ranges."""
    _check_width(width)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not -(1 << (width - 1)) <= value < (1 << width):
        raise ValueError(f"{what}={value} does not fit in {width} bits")
    return value & ((1 << width) - 1)


def _result(word: int, width: int, signed: bool) -> int:
    if signed and word >= 1 << (width - 1):
        return word - (1 << width)
    return word


def fetch_add(addr: int, value: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically adds ``value`` (wrapping at ``width`` bits) and returns the previous value."""
    return _result(_atomics.fetch_add(addr, _word(value, width, "value"), width), width, signed)


def fetch_and(addr: int, value: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically ANDs ``value`` in and returns the previous value."""
    return _result(_atomics.fetch_and(addr, _word(value, width, "value"), width), width, signed)


def fetch_or(addr: int, value: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically ORs ``value`` in and returns the previous value."""
    return _result(_atomics.fetch_or(addr, _word(value, width, "value"), width), width, signed)


def fetch_xor(addr: int, value: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically XORs ``value`` in and returns the previous value."""
    return _result(_atomics.fetch_xor(addr, _word(value, width, "value"), width), width, signed)


def compare_swap(addr: int, expected: int, desired: int, width: int = 64, *, signed: bool = False) -> int:
    """Stores ``desired`` if the word equals ``expected``; returns the value found (== expected on success)."""
    word = _atomics.compare_swap(addr, _word(expected, width, "expected"), _word(desired, width, "desired"), width)
    return _result(word, width, signed)


def swap(addr: int, value: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically replaces the word with ``value`` and returns the previous value."""
    return _result(_atomics.swap(addr, _word(value, width, "value"), width), width, signed)


def load(addr: int, width: int = 64, *, signed: bool = False) -> int:
    """Atomically reads the word at ``addr``."""
    _check_width(width)
    return _result(_atomics.load(addr, width), width, signed)


def store(addr: int, value: int, width: int = 64) -> None:
    """Atomically writes ``value`` to the word at ``addr``."""
    _atomics.store(addr, _word(value, width, "value"), width)


def wait_until(addr: int, cmp: Cmp | str, value: int, timeout: float, width: int = 64, *, signed: bool = False) -> int:
    """Blocks until the word at ``addr`` compares ``cmp`` to ``value``; returns the word then seen.

    ``cmp`` is a :class:`mori.core.codes.Cmp` or its name (``eq ne gt ge lt le``); ordered comparisons are signed
    when ``signed=True``. Spins briefly, then yields and sleeps with back-off; releases the GIL.
    Raises :class:`TimeoutError` naming the address, the condition and the last value seen if
    the condition does not hold within ``timeout`` seconds (0 checks once).
    """
    try:
        code = Cmp.parse(cmp)
    except ValueError as exc:
        raise ValueError(f"wait_until: {exc}") from None
    word = _word(value, width, "value")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"wait_until: timeout must be a number of seconds, got {type(timeout).__name__}")
    return _result(_atomics.wait_until(addr, int(code), word, float(timeout), width, signed), width, signed)
