"""Reading ``UMBP_*`` environment variables: the typed readers that ``UMBPConfig.from_environment``
uses, and the runtime knobs (timeouts, leases, intervals) with MORI's resolution rules."""

from __future__ import annotations

import logging
import os
import threading

_log = logging.getLogger("mori.umbp")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value is not None and value.strip() != "" else None


def _size(name: str, default: int) -> int:
    """A byte count or count: decimal digits. MORI's ``std::stoull`` throws on garbage; so does
    this, naming the variable."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.strip()
    if not text.isdigit():
        raise ValueError(f"{name}={raw!r}: expected a non-negative integer")
    return int(text)


def _int(name: str, default: int) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return int(raw.strip(), 10)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


def _flag(name: str, default: bool) -> bool:
    """MORI reads flags as integers (0 off, anything else on); ``true``/``false`` etc. are taken
    too. Anything else is an error naming the variable (MORI's ``atoi`` would read it as 0)."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.strip().lower()
    if text in ("true", "yes", "on"):
        return True
    if text in ("false", "no", "off"):
        return False
    try:
        return int(text, 10) != 0
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected 0/1 (or true/false)") from None


def _float(name: str, default: float) -> float:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        return float(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _str(name: str, default: str) -> str:
    value = os.environ.get(name)
    return default if value is None else value


_warned: set[str] = set()
_warned_lock = threading.Lock()


def runtime_int(name: str, default: int, min_allowed: int = 0) -> int:
    """A runtime knob (``UMBP_*_MS``, ``_SEC``, counts) by MORI's rules: unset or empty gives the
    default silently; a value that is not a base-10 integer, or is below ``min_allowed``, gives
    the default and one warning per name and process."""
    raw = _raw(name)
    if raw is None:
        return default
    text = raw.lstrip()
    try:
        value = int(text, 10)
        if text != text.rstrip() or value < min_allowed:
            raise ValueError
    except ValueError:
        with _warned_lock:
            first = name not in _warned
            _warned.add(name)
        if first:
            _log.warning("%s=%r is not an integer >= %d; using the default %d", name, raw, min_allowed, default)
        return default
    return value
