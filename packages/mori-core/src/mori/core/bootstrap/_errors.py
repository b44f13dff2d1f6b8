"""The bootstrap's exceptions."""

from __future__ import annotations

__all__ = ["BootstrapError", "BootstrapTimeout"]


class BootstrapError(RuntimeError):
    """The bootstrap network failed: a bad unique id, a rejected rank, a peer that went away."""


class BootstrapTimeout(BootstrapError, TimeoutError):
    """A bootstrap wait ran out of time; the message names the ranks that were missing."""
