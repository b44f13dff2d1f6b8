"""Per-engine metadata: local memory regions, remote engines, transfer uids, transfers in flight,
and the checks of the completion records peers send (``notify``).

Each engine keeps its own (MORI's "metadata store": no central store); every table is guarded
by a lock because transfers, the control plane and user calls run on different threads.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from mori.core.log import get_logger

from ._control import ControlError
from .types import EngineDesc, MemoryDesc, StatusCode, TransferStatus

__all__ = [
    "MemoryRegistry",
    "RemoteEngines",
    "InFlight",
    "UidAllocator",
    "MAX_NOTIFY_BATCH",
    "CompletionRecord",
    "check_notify",
    "notify_bodies",
]

_log = get_logger("io")

K = TypeVar("K")
V = TypeVar("V")


class UidAllocator:
    """Thread-safe transfer uid counter (uids are unique per initiator engine)."""

    def __init__(self) -> None:
        # allocate() is the count's own __next__ (one step under the GIL: no lock needed), with no
        # Python frame around it: every transfer takes a uid.
        self.allocate: Callable[[], int] = itertools.count(1).__next__


class _Table(Generic[K, V]):
    """A dict guarded by a lock (reads of single keys need none under the GIL), and ``changes``,
    a count of its changes (each counted after it is made) for checks that cache what they found."""

    def __init__(self) -> None:
        self._items: dict[K, V] = {}
        self._lock = threading.Lock()
        self.changes = 0
        # The value of a key or None: the dict's own get, with no Python frame around it (every
        # transfer reads its local region and remote engine here).
        self.get: Callable[[K], V | None] = self._items.get

    def put(self, key: K, value: V) -> None:
        """Records (or replaces) ``key``."""
        with self._lock:
            self._items[key] = value
            self.changes += 1

    def remove(self, key: K) -> V | None:
        """Forgets ``key``; returns its value, or None if unknown."""
        with self._lock:
            value = self._items.pop(key, None)
            self.changes += 1
            return value

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


_FINAL_CODES = frozenset(int(c) for c in StatusCode) - {int(StatusCode.INIT), int(StatusCode.IN_PROGRESS)}
_MAX_MESSAGE = 4096
MAX_NOTIFY_BATCH = 1024  # completion records one notify request may carry
_NOTIFY_MESSAGE_BYTES = 1 << 20  # messages one request carries at most (UTF-8), well inside a control frame

# A completion record: (transfer uid, final status code, message).
CompletionRecord = tuple[int, int, str]


def check_notify(body: dict[str, Any]) -> list[tuple[int, StatusCode, str]]:
    """The records of a peer's ``notify`` request: lists ``uids``, ``codes`` and ``messages`` of
    one length, at most :data:`MAX_NOTIFY_BATCH`. ``ControlError`` naming the first fault when
    any is malformed (then the caller records none)."""
    uids, codes, messages = body.get("uids"), body.get("codes"), body.get("messages")
    if not (
        isinstance(uids, list)
        and isinstance(codes, list)
        and isinstance(messages, list)
        and len(uids) == len(codes) == len(messages)
    ):
        raise ControlError(StatusCode.ERR_INVALID_ARGS, "notify: uids, codes and messages must be lists of one length")
    if len(uids) > MAX_NOTIFY_BATCH:
        raise ControlError(
            StatusCode.ERR_INVALID_ARGS,
            f"notify: {len(uids)} records in one request, at most {MAX_NOTIFY_BATCH} allowed",
        )
    return [_check_record(u, c, m) for u, c, m in zip(uids, codes, messages)]


def _check_record(uid: Any, code: Any, message: Any) -> tuple[int, StatusCode, str]:
    if type(uid) is not int or not 0 <= uid < 1 << 64:
        raise ControlError(StatusCode.ERR_INVALID_ARGS, f"notification uid {uid!r} is not an int in 0..2**64-1")
    if type(code) is not int or code not in _FINAL_CODES:
        raise ControlError(StatusCode.ERR_INVALID_ARGS, f"notification code {code!r} is not a final StatusCode")
    if not isinstance(message, str) or len(message) > _MAX_MESSAGE:
        raise ControlError(
            StatusCode.ERR_INVALID_ARGS, f"notification message must be a str of at most {_MAX_MESSAGE} characters"
        )
    return uid, StatusCode(code), message


def notify_bodies(records: Sequence[CompletionRecord]) -> Iterator[dict[str, list[Any]]]:
    """The ``notify`` requests that carry ``records`` in order, each one :func:`check_notify`
    accepts from a well-behaved sender: at most :data:`MAX_NOTIFY_BATCH` records and about 1 MiB
    of messages, each message cut to the length a record may have."""
    start = 0
    while start < len(records):
        end, size = start, 0
        while end < len(records) and end - start < MAX_NOTIFY_BATCH:
            size += 4 * min(len(records[end][2]), _MAX_MESSAGE)  # at most 4 UTF-8 bytes a character
            if size > _NOTIFY_MESSAGE_BYTES and end > start:
                break
            end += 1
        batch = records[start:end]
        yield {
            "uids": [r[0] for r in batch],
            "codes": [int(r[1]) for r in batch],
            "messages": [r[2][:_MAX_MESSAGE] for r in batch],
        }
        start = end


class InFlight:
    """This engine's transfers by local memory id, so that deregistering waits for them."""

    _PRUNE = 64  # a region's list is first pruned of finished entries at this length

    def __init__(self) -> None:
        self._by_mem: dict[int, list[tuple[TransferStatus, Any, str]]] = {}
        self._prune_at: dict[int, int] = {}  # per region: the length of its next pruning

    def add(self, mem_id: int, status: TransferStatus, backend: Any, remote_key: str) -> None:
        """Notes a transfer using local region ``mem_id`` through ``backend``."""
        entries = self._by_mem.setdefault(mem_id, [])
        entries.append((status, backend, remote_key))
        if len(entries) >= self._prune_at.get(mem_id, self._PRUNE):
            entries[:] = [e for e in entries if e[0]._running()]  # its own transfer: the memory it uses
            # Pruned again once it has doubled: with many transfers running, each one costs a
            # constant share of the scans (pruning every 64 transfers scanned them all each time).
            self._prune_at[mem_id] = max(self._PRUNE, 2 * len(entries))

    def drain(self, mem_id: int, deadline: float, grace: float) -> None:
        """Waits until ``deadline`` (monotonic) for the transfers of ``mem_id``; then has their
        backends fail the rest (``Backend.abort``) and waits up to ``grace`` seconds more for
        those to report it."""
        entries = list(self._by_mem.pop(mem_id, ()))
        self._prune_at.pop(mem_id, None)
        for status, _, _ in entries:
            status.WaitFor(max(deadline - time.monotonic(), 0.0) * 1000.0)
        late = {(id(b), key): (b, key) for status, b, key in entries if status.InProgress()}
        for backend, key in late.values():
            _log.warning(
                "deregister_memory: failing transfers to %r still using memory %d (MORI_IO_TIMEOUT)", key, mem_id
            )
            backend.abort(key)
        for status, _, _ in entries:
            status.WaitFor(grace * 1000.0)
