"""mori.core.memory.PinnedPool on plain host memory (alloc/free injected, as callers that attach a
device twin do): reuse by size, the byte limit, waits and timeouts, bad input, close while in use.
The same pool on pinned memory of a real device: test_gpu_device.py."""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import pytest

from mori.core.memory import PinnedPool


class _HostMemory:
    """alloc/free over ctypes buffers, recording what is live and every call. ``freed`` lists the
    addresses freed, in order: an address no longer live may be live again, the allocator
    reusing it for a later block."""

    def __init__(self) -> None:
        self.live: dict[int, Any] = {}
        self.freed: list[int] = []
        self.allocs = 0
        self.fail_next = False

    def alloc(self, n: int) -> int:
        if self.fail_next:
            self.fail_next = False
            raise MemoryError("scripted allocation failure")
        self.allocs += 1
        buf = ctypes.create_string_buffer(n)
        self.live[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def free(self, addr: int) -> None:
        del self.live[addr]
        self.freed.append(addr)


def _pool(limit: int | None = None, max_idle: int = 8) -> tuple[PinnedPool, _HostMemory]:
    mem = _HostMemory()
    return PinnedPool(limit, max_idle=max_idle, name="test pool", alloc=mem.alloc, free=mem.free), mem


def test_blocks_are_reused_by_size_and_idle_ones_bounded() -> None:
    pool, mem = _pool(max_idle=2)
    assert mem.live == {} and pool.held_bytes == 0  # nothing until first use
    a, b, c = (pool.try_acquire(4096) for _ in range(3))
    assert a and b and c and len({a, b, c}) == 3 and pool.size_of(a) == 4096
    ctypes.memset(a, 7, 4096)  # real memory of the asked size
    for addr in (a, b, c):
        pool.release(addr)
    assert len(mem.live) == 2 and pool.in_use == 0 and pool.held_bytes == 8192  # one freed: max_idle=2
    again = pool.try_acquire(4096)
    assert again in (a, b) and mem.allocs == 3  # an idle one, no new allocation
    other = pool.acquire(100, 1.0)
    assert pool.size_of(other) == 100 and mem.allocs == 4  # another size: its own block
    assert pool.in_use == 2 and pool.in_use_bytes == 4196


def test_the_limit_frees_idle_blocks_of_other_sizes_then_refuses() -> None:
    pool, mem = _pool(limit=10_000)
    small = pool.acquire(3000, 1.0)
    pool.release(small)  # idle: 3000 held
    big = pool.try_acquire(9000)  # passes the limit unless the idle block goes
    assert big is not None and mem.freed == [small] and pool.held_bytes == 9000
    assert pool.try_acquire(2000) is None  # 9000 out: no room, nothing to free
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="test pool: no room for a 2000-byte block in 0.1 s: 9000 of its 10000"):
        pool.acquire(2000, 0.1)
    assert time.monotonic() - t0 >= 0.1
    threading.Timer(0.1, pool.release, (big,)).start()
    got = pool.acquire(2000, 5.0)  # a waiter gets room when a block comes back
    assert got is not None and pool.held_bytes == 2000 and mem.freed == [small, big]


def test_bad_input_is_refused_and_changes_nothing() -> None:
    pool, mem = _pool(limit=8192)
    for bad, err in (("4096", TypeError), (4096.0, TypeError), (True, TypeError), (0, ValueError), (-1, ValueError)):
        with pytest.raises(err, match="nbytes"):
            pool.try_acquire(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="can never fit its limit of 8192 bytes"):
        pool.acquire(8193, 1.0)
    with pytest.raises(ValueError, match="timeout"):
        pool.acquire(64, -1)
    with pytest.raises(ValueError, match="0x10 is not a block in use"):
        pool.release(0x10)
    with pytest.raises(KeyError):
        pool.size_of(0x10)
    for kwargs in ({"limit_bytes": 0}, {"max_idle": -1}, {"max_idle": 1.5}):
        with pytest.raises(ValueError):
            PinnedPool(**kwargs)  # type: ignore[arg-type]
    assert mem.live == {} and pool.held_bytes == 0 and pool.in_use == 0


def test_a_failed_allocation_gives_its_bytes_back() -> None:
    pool, mem = _pool(limit=4096)
    mem.fail_next = True
    with pytest.raises(MemoryError):
        pool.acquire(4096, 1.0)
    assert pool.held_bytes == 0
    assert pool.acquire(4096, 1.0) in mem.live


def test_close_refuses_while_blocks_are_out() -> None:
    pool, mem = _pool()
    a = pool.acquire(512, 1.0)
    b = pool.acquire(512, 1.0)
    pool.release(b)
    assert not pool.close() and len(mem.live) == 2  # a is out: nothing freed
    assert pool.closed
    with pytest.raises(RuntimeError, match="test pool is closed"):
        pool.try_acquire(512)
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(64, 1.0)
    pool.release(a)  # after close a returned block is freed at once
    assert mem.freed[-1] == a and a not in mem.live
    assert pool.close() and mem.live == {} and pool.held_bytes == 0
    assert pool.close()  # idempotent


def test_concurrent_takers_never_share_a_block() -> None:
    pool, mem = _pool(limit=4 * 1024, max_idle=4)
    seen: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        try:
            for _ in range(200):
                addr = pool.acquire(1024, 10.0)
                ctypes.memset(addr, seed, 1024)
                time.sleep(0)
                assert ctypes.string_at(addr, 1024) == bytes([seed]) * 1024, "a block was shared"
                with lock:
                    seen.append(addr)
                pool.release(addr)
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(seen) == 1200 and pool.held_bytes <= 4096 and mem.allocs <= 4
    assert pool.close() and mem.live == {}
