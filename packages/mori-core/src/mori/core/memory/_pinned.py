"""Page-locked host memory for GPU copies, in blocks that are reused.

Copies between GPU memory and host memory run asynchronously (and at full speed) only from
page-locked ("pinned") host memory, and pinning costs milliseconds: so blocks are kept and
reused. One pool serves fixed-size staging buffers (all blocks one size, the total bounded, a
taker that waits for a free one) and copy tables of many sizes (powers of two, a few idle ones
of each kept).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .. import cuda
from ._host import check_size

__all__ = ["PinnedPool", "pinned_alloc", "pinned_free"]


def pinned_alloc(nbytes: int) -> int:
    """``nbytes`` of page-locked host memory usable from every CUDA context
    (``cuMemHostAlloc`` with ``CU_MEMHOSTALLOC_PORTABLE``); call with a context current."""
    flags = int(cuda.driver().CU_MEMHOSTALLOC_PORTABLE)
    return int(cuda.call("cuMemHostAlloc", nbytes, flags, detail=f"{nbytes} bytes of pinned host memory"))


def pinned_free(addr: int) -> None:
    """Frees memory from :func:`pinned_alloc` (``cuMemFreeHost``); call with a context current."""
    cuda.call("cuMemFreeHost", addr)


class PinnedPool:
    """Blocks of page-locked host memory, each of the size its taker asked for, reused.

    :meth:`try_acquire`/:meth:`acquire` hand out a block of exactly ``nbytes``: an idle one of that
    size, else a new allocation. :meth:`release` keeps the block idle for the next taker of that
    size; beyond ``max_idle`` idle blocks of a size it is freed. ``limit_bytes`` (None: no limit)
    bounds the bytes the pool holds, handed out and idle together: when a new block would pass it,
    idle blocks of other sizes are freed first; when it still would, :meth:`try_acquire` answers
    None and :meth:`acquire` waits for a release (up to its timeout). Memory is allocated on first
    use. ``name`` names the pool in errors.

    ``alloc(nbytes) -> address`` and ``free(address)`` default to :func:`pinned_alloc` and
    :func:`pinned_free` (a CUDA context must be current in the calling thread); callers pass their
    own to attach something to each block (a device twin) or to test on plain host memory.
    """

    def __init__(
        self,
        limit_bytes: int | None = None,
        *,
        max_idle: int = 8,
        name: str = "pinned pool",
        alloc: Callable[[int], int] = pinned_alloc,
        free: Callable[[int], None] = pinned_free,
    ) -> None:
        if limit_bytes is not None:
            check_size(limit_bytes, "limit_bytes")
        if not isinstance(max_idle, int) or isinstance(max_idle, bool) or max_idle < 0:
            raise ValueError(f"max_idle must be an int >= 0, got {max_idle!r}")
        self.limit_bytes = limit_bytes
        self.max_idle = max_idle
        self.name = name
        self._alloc, self._free = alloc, free
        self._idle: dict[int, list[int]] = {}  # size -> idle block addresses
        self._out: dict[int, int] = {}  # address -> size, blocks handed out
        self._held = 0  # bytes handed out, idle, or being allocated
        self._cond = threading.Condition()
        self._closed = False

    def _check_size(self, nbytes: int) -> None:
        check_size(nbytes, "nbytes")
        if self.limit_bytes is not None and nbytes > self.limit_bytes:
            raise ValueError(f"{self.name}: a {nbytes}-byte block can never fit its limit of {self.limit_bytes} bytes")

    def _take_locked(self, nbytes: int) -> tuple[int | None, list[int], bool]:
        """(an idle block, or None; idle blocks to free; whether to allocate a new block, its bytes
        now counted). Call with the lock held."""
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        idle = self._idle.get(nbytes)
        if idle:
            addr = idle.pop()
            self._out[addr] = nbytes
            return addr, [], False
        evicted: list[int] = []
        if self.limit_bytes is not None and self._held + nbytes > self.limit_bytes:
            for size in list(self._idle):
                while self._idle[size] and self._held + nbytes > self.limit_bytes:
                    evicted.append(self._idle[size].pop())
                    self._held -= size
            if self._held + nbytes > self.limit_bytes:
                return None, evicted, False
        self._held += nbytes
        return None, evicted, True

    def _obtain(self, nbytes: int, evicted: list[int], allocate: bool) -> int:
        """Frees ``evicted`` and, when ``allocate``, makes a new block (lock not held)."""
        for addr in evicted:
            self._free(addr)
        if not allocate:
            return 0
        try:
            addr = int(self._alloc(nbytes))
        except BaseException:
            with self._cond:
                self._held -= nbytes
                self._cond.notify_all()
            raise
        with self._cond:
            self._out[addr] = nbytes
        return addr

    def try_acquire(self, nbytes: int) -> int | None:
        """A block of ``nbytes`` (its address), or None when the limit leaves no room now."""
        with self._cond:
            # A size with an idle block was checked when that block was made: the per-transfer
            # path (a reused block) skips the check.
            if type(nbytes) is not int or not self._idle.get(nbytes):
                self._check_size(nbytes)
            found, evicted, allocate = self._take_locked(nbytes)
        if found is not None:
            return found
        return self._obtain(nbytes, evicted, allocate) or None

    def acquire(self, nbytes: int, timeout: float) -> int:
        """A block of ``nbytes``; waits up to ``timeout`` seconds for room, then raises
        ``TimeoutError``."""
        self._check_size(nbytes)
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                addr, evicted, allocate = self._take_locked(nbytes)
                if addr is not None:
                    return addr
                if allocate:
                    break
                for old in evicted:  # freed under the lock: rare, and it must not be lost
                    self._free(old)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.name}: no room for a {nbytes}-byte block in {timeout:.1f} s: "
                        f"{self.in_use_bytes} of its {self.limit_bytes} bytes are in use"
                    )
                self._cond.wait(left)
        return self._obtain(nbytes, evicted, allocate)

    def release(self, addr: int) -> None:
        """Gives back a block; ``ValueError`` for an address that is not a block handed out."""
        with self._cond:
            nbytes = self._out.pop(addr, None)
            if nbytes is None:
                raise ValueError(f"{self.name}: 0x{addr:x} is not a block in use")
            idle = self._idle.setdefault(nbytes, [])
            keep = len(idle) < self.max_idle and not self._closed
            if keep:
                idle.append(addr)
            else:
                self._held -= nbytes
            self._cond.notify_all()
        if not keep:
            self._free(addr)

    def size_of(self, addr: int) -> int:
        """The size of block ``addr`` handed out; ``KeyError`` when it is not one."""
        with self._cond:
            return self._out[addr]

    @property
    def in_use(self) -> int:
        """Blocks handed out and not yet released."""
        with self._cond:
            return len(self._out)

    @property
    def in_use_bytes(self) -> int:
        """Bytes of the blocks handed out."""
        with self._cond:
            return sum(self._out.values())

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds: handed out and idle."""
        with self._cond:
            return self._held

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (taking then fails; releasing still works)."""
        return self._closed

    def close(self) -> bool:
        """Closes the pool and frees its idle blocks; False (and nothing freed) while blocks are
        still handed out: release them, then close again."""
        with self._cond:
            self._closed = True
            if self._out:
                return False
            blocks = [addr for idle in self._idle.values() for addr in idle]
            self._idle.clear()
            self._held = 0
        for addr in blocks:
            self._free(addr)
        return True

    def __repr__(self) -> str:
        return (
            f"PinnedPool({self.name!r}, limit_bytes={self.limit_bytes}, in_use={len(self._out)}, "
            f"held_bytes={self._held}{', closed' if self._closed else ''})"
        )
