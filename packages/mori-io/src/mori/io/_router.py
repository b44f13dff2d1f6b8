"""Chooses the backend for each transfer, with failover.

Per (remote engine, local memory, remote memory): the highest-priority backend that can serve
the pair and is healthy towards that engine. A backend whose transfers failed for a backend
reason (broken connection, GPU error) reports itself unhealthy, so the next transfer goes to the
next backend that can serve; when none is healthy the best one that can serve is retried (it may
reconnect).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from .backends.base import Backend
from .types import BackendType, MemoryDesc

__all__ = ["choose_backend", "rank_backends"]


def rank_backends(backends: Mapping[BackendType, Backend]) -> tuple[Backend, ...]:
    """The backends, highest priority first (ranked once when the set changes, not per transfer)."""
    return tuple(sorted(backends.values(), key=lambda b: -b.priority))


def choose_backend(ranked: Iterable[Backend], local: MemoryDesc, remote: MemoryDesc) -> Backend | None:
    """The backend to carry a transfer between ``local`` and ``remote``, or None if none can;
    ``ranked`` as :func:`rank_backends` gives them."""
    fallback = None
    for backend in ranked:
        if backend.can_serve(local, remote):
            if backend.healthy(remote.engine_key):
                return backend
            fallback = fallback or backend
    return fallback
