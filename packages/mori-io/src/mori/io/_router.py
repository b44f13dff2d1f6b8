"""The engine's backends, and the choice of one for each transfer, with failover.

Per (remote engine, local memory, remote memory): the highest-priority backend that can serve
the pair and is healthy towards that engine. A backend whose transfers failed for a backend
reason (broken connection, GPU error) reports itself unhealthy, so the next transfer goes to the
next backend that can serve; when none is healthy the best one that can serve is retried (it may
reconnect).
"""

from __future__ import annotations

from collections.abc import Iterator

from .backends.base import Backend
from .types import BackendType, MemoryDesc

__all__ = ["Router"]


class Router:
    """Backends by type, ranked by priority once when the set changes (not per transfer).
    Changes are made under the engine's lock; reads need none. ``changes`` counts them (each
    counted after it is made)."""

    def __init__(self) -> None:
        self._by_type: dict[BackendType, Backend] = {}
        self._ranked: tuple[Backend, ...] = ()
        self.changes = 0

    def __contains__(self, kind: object) -> bool:
        return kind in self._by_type

    def __getitem__(self, kind: BackendType) -> Backend:
        return self._by_type[kind]

    def __iter__(self) -> Iterator[Backend]:
        """The backends, highest priority first."""
        return iter(self._ranked)

    def names(self) -> list[str]:
        """The types created, by name."""
        return [kind.name for kind in self._by_type]

    def add(self, kind: BackendType, backend: Backend) -> None:
        """Routes to ``backend``, the backend of ``kind``, too."""
        self._by_type[kind] = backend
        self._rank()

    def remove(self, kind: BackendType) -> Backend | None:
        """Stops routing to the backend of ``kind``; it, or None when there is none."""
        backend = self._by_type.pop(kind, None)
        self._rank()
        return backend

    def _rank(self) -> None:
        self._ranked = tuple(sorted(self._by_type.values(), key=lambda b: -b.priority))
        self.changes += 1

    def preferred(self, local: MemoryDesc, remote: MemoryDesc) -> Backend | None:
        """The highest-priority backend that can serve the pair, healthy or not: :meth:`choose`
        returns it whenever it is healthy."""
        return next((b for b in self._ranked if b.can_serve(local, remote)), None)

    def choose(self, local: MemoryDesc, remote: MemoryDesc) -> Backend | None:
        """The backend to carry a transfer between ``local`` and ``remote``, or None if none can."""
        fallback = None
        for backend in self._ranked:
            if backend.can_serve(local, remote):
                if backend.healthy(remote.engine_key):
                    return backend
                fallback = fallback or backend
        return fallback

    def close(self) -> None:
        """Closes and forgets every backend."""
        backends, self._by_type, self._ranked = self._ranked, {}, ()
        self.changes += 1
        for b in backends:
            b.close()
