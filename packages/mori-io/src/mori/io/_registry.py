"""Per-engine metadata: local memory regions, remote engines, transfer uids, inbound records.

Each engine keeps its own (MORI's "metadata store": no central store); every table is guarded
by a lock because transfers, the control plane and user calls run on different threads.
"""

from __future__ import annotations

import itertools
import threading
from typing import Generic, TypeVar

from .types import EngineDesc, MemoryDesc, StatusCode, TransferStatus

__all__ = ["MemoryRegistry", "RemoteEngines", "InboundTable", "UidAllocator"]

K = TypeVar("K")
V = TypeVar("V")


class UidAllocator:
    """Thread-safe transfer uid counter (uids are unique per initiator engine)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """The next uid."""
        with self._lock:
            return next(self._next)


class _Table(Generic[K, V]):
    """A dict guarded by a lock (reads of single keys need none under the GIL)."""

    def __init__(self) -> None:
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()

    def put(self, key: K, value: V) -> None:
        """Records (or replaces) ``key``."""
        with self._lock:
            self._items[key] = value

    def remove(self, key: K) -> V | None:
        """Forgets ``key``; returns its value, or None if unknown."""
        with self._lock:
            return self._items.pop(key, None)

    def get(self, key: K) -> V | None:
        """The value of ``key`` or None."""
        return self._items.get(key)

    def all(self) -> list[V]:
        """Every value."""
        with self._lock:
            return list(self._items.values())

    def __contains__(self, key: object) -> bool:
        return key in self._items


class MemoryRegistry(_Table[int, MemoryDesc]):
    """Local regions by id."""

    def __init__(self) -> None:
        super().__init__()
        self._ids = itertools.count(1)

    def new_id(self) -> int:
        """A fresh region id."""
        with self._lock:
            return next(self._ids)

    def add(self, desc: MemoryDesc) -> None:
        """Records a region."""
        self.put(desc.id, desc)


class RemoteEngines(_Table[str, EngineDesc]):
    """Registered remote engines by key."""

    def add(self, desc: EngineDesc) -> None:
        """Records (or replaces) a remote engine."""
        self.put(desc.key, desc)


class InboundTable:
    """Completion records of transfers other engines ran into this one (pop once)."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, int], tuple[StatusCode, str]] = {}
        self._lock = threading.Lock()

    def record(self, remote_key: str, uid: int, code: StatusCode, message: str = "") -> None:
        """Stores the outcome of transfer ``uid`` from ``remote_key``."""
        with self._lock:
            self._records[(remote_key, uid)] = (StatusCode(code), message)

    def pop(self, remote_key: str, uid: int) -> TransferStatus | None:
        """Removes and returns the record, or None when there is none (yet)."""
        with self._lock:
            rec = self._records.pop((remote_key, uid), None)
        return None if rec is None else TransferStatus(*rec)
