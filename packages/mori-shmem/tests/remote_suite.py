"""The checks the cross-host tests run on every PE (test_remote.py): every host RMA op to and from
every PE with every byte checked, shmem_ptr_p2p, and barriers in a row. Module-level functions,
sent to PE processes by PePool."""

from __future__ import annotations

import ctypes
import hashlib
import os

import numpy as np

import mori.shmem as shmem

#: Put/get sizes: one byte and a page (staged through the heap), and a large odd size (registered
#: for the call, two blocks, rendezvous on UCX's tcp).
SIZES = (1, 4096, (1 << 20) + 3)


def _pattern(writer: int, target: int, size: int) -> bytes:
    """Bytes only (writer, target, size) give, different for every pair."""
    seed = hashlib.blake2b(f"{writer}->{target}:{size}".encode(), digest_size=16).digest()
    return (seed * (size // 16 + 1))[:size]


def pe_rma_everywhere(remote_expected: list[int]) -> dict[str, object]:
    """Every PE puts to, gets from, signals and applies atomics on every PE (itself included);
    returns what it saw. ``remote_expected``: the PEs this PE should reach remotely."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    info = shmem.shmem_heap_info()
    assert info["remote"] == remote_expected, (info["remote"], remote_expected)
    slot = max(SIZES)
    area = shmem.shmem_malloc(slot * n * len(SIZES))  # [size index][writer] slots
    counter = shmem.shmem_malloc(8)
    words = shmem.shmem_malloc(16 * (n + 1))  # per writer: a 64-bit and a 32-bit word; then a sum
    shmem.shmem_putmem(area, b"\0" * (slot * n * len(SIZES)), me)
    shmem.shmem_putmem(counter, b"\0" * 8, me)
    shmem.shmem_putmem(words, b"\0" * (16 * (n + 1)), me)
    shmem.shmem_barrier_all()
    try:
        p2p = [shmem.shmem_ptr_p2p(area, me, pe) != 0 for pe in range(n)]
        assert p2p == [pe not in remote_expected for pe in range(n)], p2p

        def at(size_index: int, writer: int) -> int:
            return area + (size_index * n + writer) * slot

        # Puts to every PE, then every PE checks what arrived from each writer.
        for target in range(n):
            for i, size in enumerate(SIZES):
                shmem.shmem_putmem(at(i, me), _pattern(me, target, size), target)
        shmem.shmem_quiet()
        shmem.shmem_barrier_all()
        for writer in range(n):
            for i, size in enumerate(SIZES):
                got = shmem.shmem_getmem(at(i, writer), size, me)
                assert got == _pattern(writer, me, size), f"put {writer}->{me} of {size} bytes differs"
        # Gets from every PE, into bytes, a bytearray and a numpy array.
        for source in range(n):
            for i, size in enumerate(SIZES):
                want = _pattern(me, source, size)
                assert shmem.shmem_getmem(at(i, me), size, source) == want, f"get {source} of {size}"
                out = bytearray(size)
                shmem.shmem_getmem_into(out, at(i, me), source)
                assert out == want
                arr = np.zeros(size, dtype=np.uint8)
                shmem.shmem_getmem_into(arr, at(i, me), source)
                assert arr.tobytes() == want
        shmem.shmem_barrier_all()
        # A put whose source is this PE's own heap (sent as is, neither staged nor registered).
        scratch = shmem.shmem_malloc(70000)
        shmem.shmem_putmem(scratch, _pattern(me, -1, 70000), me)
        for target in range(n):
            shmem.shmem_putmem(at(2, me), (ctypes.c_char * 70000).from_address(scratch), target)
        shmem.shmem_barrier_all()
        for writer in range(n):
            assert shmem.shmem_getmem(at(2, writer), 70000, me) == _pattern(writer, -1, 70000), f"heap put {writer}"
        shmem.shmem_barrier_all()
        shmem.shmem_free(scratch)
        # Signal puts: each PE sends a fresh block to every PE and adds 1 to its counter.
        for target in range(n):
            shmem.shmem_putmem_signal(
                at(0, me), _pattern(me + n, target, SIZES[1]), counter, 1, shmem.SHMEM_SIGNAL_ADD, target
            )
        assert shmem.shmem_wait_until(counter, shmem.SHMEM_CMP_EQ, n, timeout=60) == n
        for writer in range(n):
            # The counter reached n only after every writer's data: a PE that sees it sees them.
            assert shmem.shmem_getmem(at(0, writer), SIZES[1], me) == _pattern(writer + n, me, SIZES[1])
        shmem.shmem_barrier_all()
        shmem.shmem_putmem_signal(at(1, me), b"set", counter, 1000 + me, shmem.SHMEM_SIGNAL_SET, (me + 1) % n)
        left = (me - 1) % n
        assert shmem.shmem_wait_until(counter, shmem.SHMEM_CMP_EQ, 1000 + left, timeout=60) == 1000 + left
        assert shmem.shmem_getmem(at(1, left), 3, me) == b"set"
        shmem.shmem_barrier_all()
        # A signal put larger than one message carries (the put, then the signal).
        shmem.shmem_putmem_signal(
            at(2, me), _pattern(me, -2, 70000), counter, 2000 + me, shmem.SHMEM_SIGNAL_SET, (me + 1) % n
        )
        assert shmem.shmem_wait_until(counter, shmem.SHMEM_CMP_EQ, 2000 + left, timeout=60) == 2000 + left
        assert shmem.shmem_getmem(at(2, left), 70000, me) == _pattern(left, -2, 70000)
        shmem.shmem_barrier_all()
        # Atomics on every PE: fetch-add from every PE (old values distinct, the sum exact), then
        # compare-swap, swap, set and fetch on this PE's own words there, 64- and 32-bit.
        olds = [shmem.shmem_atomic_fetch_add(words + 16 * n, me + 1, target) for target in range(n)]
        for target in range(n):
            w64, w32 = words + 16 * me, words + 16 * me + 8
            assert shmem.shmem_atomic_compare_swap(w64, 0, (1 << 63) + me, target) == 0
            assert shmem.shmem_atomic_compare_swap(w64, 5, 7, target) == (1 << 63) + me  # no swap
            assert shmem.shmem_atomic_swap(w64, -1, target) == (1 << 63) + me  # -1 wraps
            assert shmem.shmem_atomic_fetch(w64, target) == (1 << 64) - 1
            shmem.shmem_atomic_set(w32, 0xFFFFFFFF, target, width=32)
            assert shmem.shmem_atomic_fetch_add(w32, 2, target, width=32) == 0xFFFFFFFF  # wraps to 1
            shmem.shmem_atomic_add(w32, 10, target, width=32)
            assert shmem.shmem_atomic_fetch(w32, target, width=32) == 11
        shmem.shmem_fence()
        shmem.shmem_quiet()
        shmem.shmem_barrier_all()
        total = shmem.shmem_atomic_fetch(words + 16 * n, me)
        mine = [shmem.shmem_atomic_fetch(words + 16 * pe, me) for pe in range(n)]
        assert total == n * (n + 1) // 2 and mine == [(1 << 64) - 1] * n, (total, mine)
        # The checks of any put come before the route: a bad address to a remote PE changes nothing.
        for target in range(n):
            try:
                shmem.shmem_putmem(counter, b"x" * 16, target)  # past the 8-byte block
            except shmem.ShmemAddressError:
                pass
            else:
                raise AssertionError("an out-of-block put was not refused")
        # The same from a source in this PE's heap, the put that one native call moves when it is
        # plain (the heap window's quick_put): a wrong one still gets the checked path's error, and nothing moves.
        in_heap = (ctypes.c_char * 16).from_address(area)
        heap_base = int(info["base"], 16)
        for target in range(n):
            for dest, why in (
                (counter, "past the end of the 8-byte block"),
                (heap_base + 64, "reserved for mori"),
                (heap_base - 16, "outside the symmetric heap"),
            ):
                try:
                    shmem.shmem_putmem(dest, in_heap, target)
                except shmem.ShmemAddressError as err:
                    assert why in str(err), (why, str(err))
                else:
                    raise AssertionError(f"a put from the heap to {dest:#x} ({why}) was not refused")
            try:
                shmem.shmem_putmem(area, in_heap, n)
            except ValueError as err:
                assert f"there are {n} PEs" in str(err), str(err)
            else:
                raise AssertionError("a put to PE n was not refused")
        return {"olds": olds, "p2p": p2p}
    finally:
        shmem.shmem_barrier_all()
        for ptr in (area, counter, words):
            shmem.shmem_free(ptr)


def pe_barriers(count: int) -> int:
    """``count`` barriers in a row, with a remote atomic between them to keep ordering honest."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    word = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(word, 0, me)
    shmem.shmem_barrier_all()
    for i in range(count):
        if i % 100 == 0:
            shmem.shmem_atomic_add(word, 1, (me + 1) % n)
        shmem.shmem_barrier_all()
    value = shmem.shmem_atomic_fetch(word, me)
    shmem.shmem_barrier_all()
    shmem.shmem_free(word)
    return value


def pe_die_or_reach(victim: int) -> str:
    """The victim PE exits at once; every other PE enters a barrier (which cannot complete without
    the victim: when it fails, the victim is gone), then puts to it and applies an atomic there,
    and reports what each raised."""
    me = shmem.shmem_mype()
    buf = shmem.shmem_malloc(4096)
    shmem.shmem_barrier_all()
    if me == victim:
        os._exit(7)
    report = []
    try:
        shmem.shmem_barrier_all()
        report.append("barrier returned")
    except Exception as exc:
        report.append(f"barrier: {type(exc).__name__}: {exc}")
    try:
        shmem.shmem_putmem(buf, b"x" * 4096, victim)
        shmem.shmem_atomic_fetch_add(buf, 1, victim)
        report.append("put and atomic to the dead PE returned")
    except shmem.ShmemError as exc:
        report.append(f"rma: {exc}")
    return " | ".join(report)


def pe_ready(victim: int) -> int:
    """A block to aim at, allocated on every PE alike; returns its address."""
    buf = shmem.shmem_malloc(4096)
    shmem.shmem_barrier_all()
    return buf


def pe_reach_hung(buf: int, victim: int) -> tuple[str, float]:
    """A put and an atomic to the (stopped) victim: what each raised, and the seconds it took."""
    import time

    start = time.monotonic()
    errors = []
    for call in (lambda: shmem.shmem_putmem(buf, b"y" * 4096, victim), lambda: shmem.shmem_atomic_add(buf, 1, victim)):
        try:
            call()
            errors.append("returned")
        except shmem.ShmemError as exc:
            errors.append(str(exc))
    return " | ".join(errors), time.monotonic() - start


def pe_threads_put(threads: int) -> None:
    """``threads`` threads of this PE put to the next PE at once (small puts share the staging
    area, larger ones are registered each), and get back; every byte checked after a barrier."""
    import threading

    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    right, left = (me + 1) % n, (me - 1) % n
    sizes = (100, 70000)
    slot = sum(sizes)
    area = shmem.shmem_malloc(slot * threads * n)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            pos = area + (me * threads + t) * slot
            for i in range(20):
                for size, off in zip(sizes, (0, sizes[0])):
                    data = _pattern(me * 1000 + t, i, size)
                    shmem.shmem_putmem(pos + off, data, right)
                    assert shmem.shmem_getmem(pos + off, size, right) == data
        except BaseException as exc:  # reported below
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert not errors, errors
    shmem.shmem_barrier_all()
    for t in range(threads):
        pos = area + (left * threads + t) * slot
        assert shmem.shmem_getmem(pos, sizes[0], me) == _pattern(left * 1000 + t, 19, sizes[0])
        assert shmem.shmem_getmem(pos + sizes[0], sizes[1], me) == _pattern(left * 1000 + t, 19, sizes[1])
    shmem.shmem_barrier_all()
    shmem.shmem_free(area)


def pe_registered_buffer(sizes: tuple[int, ...]) -> dict[str, object]:
    """Puts from and gets into a buffer outside the heap, to and from the next PE, before
    shmem_buffer_register, while registered and after shmem_buffer_deregister; returns the
    remote transport's counts (shmem_heap_info's ``remote_stats``) after each stage. Every byte
    checked."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    right = (me + 1) % n
    total = sum(sizes)
    area = shmem.shmem_malloc(total)
    buf = np.zeros(total, dtype=np.uint8)  # outside the heap
    addr = buf.ctypes.data
    seen: dict[str, object] = {"before": shmem.shmem_heap_info()["remote_stats"]}

    def round_trip(stage: str) -> None:
        pos = 0
        for size in sizes:
            data = np.frombuffer(_pattern(me, len(stage), size), dtype=np.uint8)
            buf[pos : pos + size] = data
            shmem.shmem_putmem(area + pos, buf[pos : pos + size], right)
            buf[pos : pos + size] = 0
            shmem.shmem_getmem_into(buf[pos : pos + size], area + pos, right)
            assert bytes(buf[pos : pos + size]) == data.tobytes(), f"{stage}: {size} bytes differ"
            pos += size
        seen[stage] = shmem.shmem_heap_info()["remote_stats"]

    round_trip("unregistered")
    assert shmem.shmem_buffer_register(addr, total) == 0
    seen["registering"] = shmem.shmem_heap_info()["remote_stats"]
    round_trip("registered")
    assert shmem.shmem_buffer_deregister(addr, total) == 0
    round_trip("deregistered")
    shmem.shmem_barrier_all()
    shmem.shmem_free(area)
    return seen


def pe_remote_transports() -> list[str]:
    """The transports (``transport/device``) of the remote transport's UCX context."""
    from mori.core.ucx import transports
    from mori.shmem import _state

    return transports(_state.current().rma.remote.describe())


def pe_remote_eager_bytes() -> int:
    """The remote transport's engine's ``eager_bytes``."""
    from mori.shmem import _state

    return int(_state.current().rma.remote.eager_bytes)
