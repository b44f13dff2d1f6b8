"""Chooses the backend for each transfer, with failover.

Per (remote engine, local memory, remote memory): the highest-priority backend that can serve
the pair and is healthy towards that engine. A backend whose transfers failed for a backend
reason (broken connection, GPU error) reports itself unhealthy, so the next transfer goes to the
next backend that can serve; when none is healthy the best one that can serve is retried (it may
reconnect).
"""

from __future__ import annotations

from collections.abc import Mapping

from .backends.base import Backend
from .types import BackendType, MemoryDesc

__all__ = ["choose_backend"]


def choose_backend(backends: Mapping[BackendType, Backend], local: MemoryDesc, remote: MemoryDesc) -> Backend | None:
    """The backend to carry a transfer between ``local`` and ``remote``, or None if none can."""
    able = sorted((b for b in backends.values() if b.can_serve(local, remote)), key=lambda b: -b.priority)
    for backend in able:
        if backend.healthy(remote.engine_key):
            return backend
    return able[0] if able else None
