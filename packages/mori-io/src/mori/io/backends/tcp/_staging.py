"""Host-side parts of GPU staging for the TCP backend (no CUDA here, so they run in CPU tests).

The native TCP data plane only touches host memory, so GPU memory travels through pinned host
buffers of a fixed size (a *chunk*, cut by ``plan.plan_chunks``): :class:`StagingPool` hands out
pinned buffers (mori-core's pool) up to a bound, and :class:`SlotLeases` tracks the buffers a target lends to initiators between the control
request that fills or lends one and the one that returns it.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mori.core.memory import PinnedPool

from ._staging_size import CHUNK_BYTES, chunk_bytes_for
from .plan import MAX_PIECES

__all__ = ["CHUNK_BYTES", "chunk_bytes_for", "StagingPool", "SlotLeases",
           "check_pieces", "pack_array", "unpack_array"]

def pack_array(values: np.ndarray) -> bytes:
    """int64 little-endian bytes of ``values`` (for a control frame)."""
    return np.ascontiguousarray(values, dtype="<i8").tobytes()


def unpack_array(data: object, name: str) -> np.ndarray:
    """The int64 array sent by :func:`pack_array`; ``ValueError`` naming ``name`` when malformed."""
    if not isinstance(data, (bytes, bytearray)) or len(data) % 8:
        raise ValueError(f"{name} must be int64 bytes")
    return np.frombuffer(bytes(data), dtype="<i8").astype(np.int64)


def check_pieces(offsets: np.ndarray, sizes: np.ndarray, region_size: int, buffer_size: int) -> str:
    """Why pieces (offsets, sizes) cannot be staged for a region of ``region_size`` bytes through
    one buffer of ``buffer_size`` bytes, or '' when they can."""
    if len(offsets) != len(sizes) or not 0 < len(sizes) <= MAX_PIECES:
        return f"expected 1..{MAX_PIECES} offsets and as many sizes, got {len(offsets)} and {len(sizes)}"
    if offsets.min() < 0 or sizes.min() <= 0:
        return "offsets must be >= 0 and sizes > 0"
    # No overflow: offsets <= region_size is checked before adding.
    if offsets.max() > region_size or (offsets + sizes).max() > region_size:
        return f"a piece runs past the end of the region ({region_size} bytes)"
    if int(sizes.sum()) > buffer_size:
        return f"pieces of {int(sizes.sum())} bytes exceed a staging buffer ({buffer_size} bytes)"
    return ""


class StagingPool:
    """``count`` buffers of ``chunk_bytes`` each: fixed-size blocks of a
    :class:`mori.core.memory.PinnedPool` bounded to ``count`` buffers, allocated on first use and
    kept until :meth:`close`.

    ``alloc(nbytes) -> address`` and ``free(address)`` make and release the memory (pinned host
    memory on a GPU machine; tests pass plain host memory).
    """

    def __init__(self, total_bytes: int, alloc: Callable[[int], int], free: Callable[[int], None]) -> None:
        self.chunk_bytes = chunk_bytes_for(total_bytes)
        self.count = total_bytes // self.chunk_bytes
        self._pinned = PinnedPool(self.count * self.chunk_bytes, max_idle=self.count, name="the staging pool",
                                  alloc=alloc, free=free)

    def try_acquire(self) -> int | None:
        """A free buffer's address, or None when all are in use."""
        return self._pinned.try_acquire(self.chunk_bytes)

    def acquire(self, timeout: float) -> int:
        """A free buffer's address; waits up to ``timeout`` seconds, then raises ``TimeoutError``."""
        try:
            return self._pinned.acquire(self.chunk_bytes, timeout)
        except TimeoutError:
            raise TimeoutError(f"no staging buffer free for {timeout:.1f} s: all {self.count} buffers of "
                               f"{self.chunk_bytes} bytes in use (MORI_IO_TCP_STAGING_SIZE)") from None

    def release(self, addr: int) -> None:
        """Returns a buffer; ``ValueError`` for an address that is not a buffer in use."""
        try:
            self._pinned.release(addr)
        except ValueError:
            raise ValueError(f"0x{addr:x} is not a staging buffer in use") from None

    @property
    def in_use(self) -> int:
        """Buffers handed out and not yet returned."""
        return self._pinned.in_use

    def close(self) -> bool:
        """Frees the buffers; False (and nothing freed) while buffers are still in use (each is
        freed when it comes back)."""
        return self._pinned.close()


@dataclass
class _Lease:
    key: str
    addr: int
    expires: float


class SlotLeases:
    """Buffers a target lends to initiators, each under a random 62-bit id (far from engine
    memory ids) that the data plane serves while the lease lasts.

    ``expose(id, addr, size)`` / ``hide(id)`` make a buffer reachable by the data plane and
    take it back (``hide`` waits for requests in flight on it). A lease not returned within
    ``ttl`` seconds (its initiator died) is reclaimed at the next lease.
    """

    def __init__(self, pool: StagingPool, ttl: float, expose: Callable[[int, int, int], None],
                 hide: Callable[[int], object]) -> None:
        self.pool = pool
        self._ttl = ttl
        self._expose, self._hide = expose, hide
        self._leases: dict[int, _Lease] = {}
        self._lock = threading.Lock()

    def take_buffer(self) -> int | None:
        """A pool buffer for a new lease (expired leases reclaimed first), or None when busy."""
        now = time.monotonic()
        with self._lock:
            expired = [i for i, lease in self._leases.items() if lease.expires < now]
            gone = [(i, self._leases.pop(i)) for i in expired]
        for i, lease in gone:
            self._give_back(i, lease.addr)
        return self.pool.try_acquire()

    def lend(self, key: str, addr: int) -> int:
        """Lends buffer ``addr`` (from :meth:`take_buffer`) to engine ``key``; returns its id."""
        slot = secrets.randbits(62) | (1 << 62)
        self._expose(slot, addr, self.pool.chunk_bytes)
        with self._lock:
            self._leases[slot] = _Lease(key, addr, time.monotonic() + self._ttl)
        return slot

    def take_back(self, key: str, slot: int) -> int:
        """Ends the lease of ``slot`` held by ``key``: the data plane stops serving it; returns the
        buffer's address (still out of the pool: hand it to :meth:`return_buffer`). ``KeyError``
        when ``key`` holds no such lease."""
        with self._lock:
            lease = self._leases.get(slot)
            if lease is None or lease.key != key:
                raise KeyError(f"no staging slot {slot} lent to engine {key!r} (returned or expired)")
            del self._leases[slot]
        self._hide(slot)
        return lease.addr

    def return_buffer(self, addr: int) -> None:
        """Puts a buffer back in the pool."""
        self.pool.release(addr)

    def _give_back(self, slot: int, addr: int) -> None:
        self._hide(slot)
        self.pool.release(addr)

    def release_engine(self, key: str) -> None:
        """Ends every lease held by ``key`` (the engine was deregistered)."""
        with self._lock:
            gone = [(i, self._leases.pop(i)) for i, lease in list(self._leases.items()) if lease.key == key]
        for i, lease in gone:
            self._give_back(i, lease.addr)

    def close(self) -> None:
        """Ends every lease."""
        with self._lock:
            gone = list(self._leases.items())
            self._leases.clear()
        for i, lease in gone:
            self._give_back(i, lease.addr)
