"""Checks of what a caller (or a peer, over the wire) hands the pool: keys, addresses, sizes and
batch shapes. Each raises TypeError or ValueError naming the argument, before anything changes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: The longest key, in UTF-8 bytes. SGLang's are a hash and a short suffix (~80 bytes).
MAX_KEY_BYTES = 1024
_MAX_ADDRESS = (1 << 64) - 1


def check_key(key: Any, what: str = "key") -> str:
    """A key: a str of 1..MAX_KEY_BYTES UTF-8 bytes without NUL."""
    if not isinstance(key, str):
        raise TypeError(f"{what} must be a str, not {type(key).__name__}")
    try:
        length = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{what} {key!r} is not valid UTF-8 (lone surrogate)") from None
    if length == 0:
        raise ValueError(f"{what} must not be empty")
    if length > MAX_KEY_BYTES:
        raise ValueError(f"{what} is {length} bytes long; the most is {MAX_KEY_BYTES}")
    if "\0" in key:
        raise ValueError(f"{what} {key!r} contains a NUL character")
    return key


def check_keys(keys: Sequence[Any], what: str = "keys") -> list[str]:
    """Each key as :func:`check_key` checks it (``what[i]`` named in the error). A batch of ASCII
    keys without NUL of 1..MAX_KEY_BYTES characters passes at once, checked whole: key by key, a
    batch of a thousand keys spent 0.1 ms or more."""
    out = list(keys)
    if _plain_ascii(out):
        return out
    for i, key in enumerate(out):
        if not (type(key) is str and key.isascii() and 0 < len(key) <= MAX_KEY_BYTES and "\0" not in key):
            check_key(key, f"{what}[{i}]")
    return out


def _plain_ascii(keys: list[Any]) -> bool:
    """Whether every key is a str of 1..MAX_KEY_BYTES ASCII characters without NUL, in C loops
    over the batch rather than a Python one (a str knows whether it is ASCII without a scan)."""
    try:
        joined = "".join(keys)  # TypeError for anything but str (a subclass passes, as in check_key)
    except TypeError:
        return False
    return joined.isascii() and "\0" not in joined and all(keys) and max(map(len, keys), default=0) <= MAX_KEY_BYTES


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return value.__index__()


def check_address(value: Any, what: str) -> int:
    """A memory address: a nonzero int that fits 64 bits."""
    address = _int(value, what)
    if not 0 < address <= _MAX_ADDRESS:
        raise ValueError(f"{what} must be a nonzero 64-bit address, got {address:#x}")
    return address


def check_size(value: Any, what: str, most: int) -> int:
    """A byte count in [1, most]."""
    size = _int(value, what)
    if not 0 < size <= most:
        raise ValueError(f"{what} must be in [1, {most}], got {size}")
    return size


def check_offset(value: Any, what: str) -> int:
    offset = _int(value, what)
    if offset < 0:
        raise ValueError(f"{what} must be >= 0, got {offset}")
    return offset


def as_list(value: Any, what: str) -> list[Any]:
    """A batch argument as a list (any sequence but a str or bytes)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        if hasattr(value, "tolist"):  # numpy arrays, torch tensors
            return list(value.tolist())
        raise TypeError(f"{what} must be a list, not {type(value).__name__}")
    return list(value)


def check_lengths(**batches: Sequence[Any]) -> int:
    """The common length of batch arguments, or ValueError naming them all."""
    lengths = {name: len(items) for name, items in batches.items()}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"batch arguments differ in length: {shown}")
    return next(iter(lengths.values()), 0)
