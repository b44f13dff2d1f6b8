"""Per-engine metadata: local memory regions, remote engines, transfer uids, inbound records.

Each engine keeps its own (MORI's "metadata store": no central store); every table is guarded
by a lock because transfers, the control plane and user calls run on different threads.
"""

from __future__ import annotations

import itertools
import threading

from .types import EngineDesc, MemoryDesc, StatusCode, TransferStatus

__all__ = ["MemoryRegistry", "RemoteEngines", "InboundTable", "UidAllocator"]


class UidAllocator:
    """Thread-safe transfer uid counter (uids are unique per initiator engine)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def allocate(self) -> int:
        """The next uid."""
        with self._lock:
            return next(self._next)


class MemoryRegistry:
    """Local regions by id."""

    def __init__(self) -> None:
        self._by_id: dict[int, MemoryDesc] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def new_id(self) -> int:
        """A fresh region id."""
        with self._lock:
            return next(self._ids)

    def add(self, desc: MemoryDesc) -> None:
        """Records a region."""
        with self._lock:
            self._by_id[desc.id] = desc

    def remove(self, mem_id: int) -> MemoryDesc | None:
        """Forgets a region; returns it, or None if unknown."""
        with self._lock:
            return self._by_id.pop(mem_id, None)

    def get(self, mem_id: int) -> MemoryDesc | None:
        """The region ``mem_id`` or None."""
        return self._by_id.get(mem_id)

    def all(self) -> list[MemoryDesc]:
        """Every registered region."""
        with self._lock:
            return list(self._by_id.values())


class RemoteEngines:
    """Registered remote engines by key."""

    def __init__(self) -> None:
        self._by_key: dict[str, EngineDesc] = {}
        self._lock = threading.Lock()

    def add(self, desc: EngineDesc) -> None:
        """Records (or replaces) a remote engine."""
        with self._lock:
            self._by_key[desc.key] = desc

    def remove(self, key: str) -> EngineDesc | None:
        """Forgets a remote engine."""
        with self._lock:
            return self._by_key.pop(key, None)

    def get(self, key: str) -> EngineDesc | None:
        """The remote engine ``key`` or None."""
        return self._by_key.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key


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
