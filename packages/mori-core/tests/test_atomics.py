"""Native host atomics: exact results under contention from real processes, waits, bad input."""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import atomics
from mori.core.memory import HostSegment
from mori.core.testing import run_procs

N_PROCS = 4


def _attach(fd_path: str, size: int) -> HostSegment:
    # Children map the parent's segment through /proc/<pid>/fd: a real cross-process mapping
    # without a socket (fd passing itself is tested in test_memory.py).
    fd = os.open(fd_path, os.O_RDWR)
    try:
        return HostSegment.attach(fd, size)
    finally:
        os.close(fd)


def _fetch_add_worker(fd_path: str, size: int, iters: int) -> tuple[list[int], list[int]]:
    seg = _attach(fd_path, size)
    try:
        atomics.fetch_add(seg.addr + 64, 1)  # arrival count, then wait for everyone: maximal contention
        atomics.wait_until(seg.addr + 64, "ge", N_PROCS, timeout=60)
        olds64 = [atomics.fetch_add(seg.addr, 1) for _ in range(iters)]
        olds32 = [atomics.fetch_add(seg.addr + 8, 3, width=32) for _ in range(iters)]
        return olds64, olds32
    finally:
        seg.close()


def _proc_path(seg: HostSegment) -> str:
    return f"/proc/{os.getpid()}/fd/{seg.fd}"


def test_fetch_add_from_four_processes_sums_exactly() -> None:
    iters = 10_000
    with HostSegment.create(4096) as seg:
        results = run_procs(_fetch_add_worker, [(_proc_path(seg), seg.size, iters)] * N_PROCS)
        total = N_PROCS * iters
        assert atomics.load(seg.addr) == total
        assert atomics.load(seg.addr + 8, width=32) == 3 * total
        # Every increment saw a distinct previous value: no update was lost or duplicated.
        assert sorted(v for olds, _ in results for v in olds) == list(range(total))
        assert sorted(v for _, olds in results for v in olds) == list(range(0, 3 * total, 3))


def _cas_worker(fd_path: str, size: int, iters: int) -> list[int]:
    seg = _attach(fd_path, size)
    won = []
    try:
        for _ in range(iters):
            while True:
                seen = atomics.load(seg.addr, width=32)
                if atomics.compare_swap(seg.addr, seen, seen + 1, width=32) == seen:
                    won.append(seen)
                    break
        return won
    finally:
        seg.close()


def test_compare_swap_increments_from_four_processes() -> None:
    iters = 2_000
    with HostSegment.create(4096) as seg:
        results = run_procs(_cas_worker, [(_proc_path(seg), seg.size, iters)] * N_PROCS)
        assert atomics.load(seg.addr, width=32) == N_PROCS * iters
        assert sorted(v for won in results for v in won) == list(range(N_PROCS * iters))


def _swap_worker(fd_path: str, size: int, rank: int, iters: int) -> list[int]:
    seg = _attach(fd_path, size)
    try:
        return [atomics.swap(seg.addr, (rank + 1) << 32 | i) for i in range(iters)]
    finally:
        seg.close()


def test_swap_from_four_processes_conserves_tokens() -> None:
    iters = 3_000
    with HostSegment.create(4096) as seg:
        results = run_procs(_swap_worker, [(_proc_path(seg), seg.size, r, iters) for r in range(N_PROCS)])
        # Each token is swapped in once and comes out once, except the last one, which stays.
        outs = Counter(v for olds in results for v in olds)
        outs[atomics.load(seg.addr)] += 1
        tokens = Counter({(r + 1) << 32 | i: 1 for r in range(N_PROCS) for i in range(iters)})
        tokens[0] += 1  # the initial zero comes out of the first swap
        assert outs == tokens


_OPS = st.sampled_from(["add", "and", "or", "xor", "swap", "cas_hit", "cas_miss", "store"])


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([32, 64]), data=st.data())
def test_operations_match_a_model(width: int, data: st.DataObject) -> None:
    mask = (1 << width) - 1
    value_st = st.integers(-(1 << (width - 1)), mask)
    with HostSegment.create(4096) as seg:
        addr = seg.addr + 8 * data.draw(st.integers(0, 500))
        model = 0
        for _ in range(data.draw(st.integers(1, 30))):
            op, v = data.draw(_OPS), data.draw(value_st)
            u = v & mask
            if op == "add":
                assert atomics.fetch_add(addr, v, width) == model
                model = (model + u) & mask
            elif op == "and":
                assert atomics.fetch_and(addr, v, width) == model
                model &= u
            elif op == "or":
                assert atomics.fetch_or(addr, v, width) == model
                model |= u
            elif op == "xor":
                assert atomics.fetch_xor(addr, v, width) == model
                model ^= u
            elif op == "swap":
                assert atomics.swap(addr, v, width) == model
                model = u
            elif op == "cas_hit":
                assert atomics.compare_swap(addr, model, v, width) == model
                model = u
            elif op == "cas_miss":
                assert atomics.compare_swap(addr, model ^ 1, v, width) == model
            else:
                atomics.store(addr, v, width)
                model = u
            assert atomics.load(addr, width) == model
            signed = model - (1 << width) if model >> (width - 1) else model
            assert atomics.load(addr, width, signed=True) == signed
        # Only the addressed word changed.
        raw = bytes(seg.view())
        off = addr - seg.addr
        assert raw[:off].count(0) == off and raw[off + width // 8 :].count(0) == len(raw) - off - width // 8


def test_32_bit_ops_leave_the_neighbouring_word_alone() -> None:
    with HostSegment.create(4096) as seg:
        atomics.store(seg.addr, 0x1111_1111_2222_2222)
        atomics.fetch_add(seg.addr, 0xFFFF_FFFF, width=32)  # little endian: the low word, wrapping
        assert atomics.load(seg.addr) == 0x1111_1111_2222_2221
        atomics.swap(seg.addr + 4, -1, width=32)
        assert atomics.load(seg.addr) == 0xFFFF_FFFF_2222_2221


def test_wait_until_times_out_naming_address_condition_and_last_value() -> None:
    with HostSegment.create(4096) as seg:
        atomics.store(seg.addr + 16, 7)
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            atomics.wait_until(seg.addr + 16, "ge", 8, timeout=0.3)
        assert time.monotonic() - start >= 0.3
        message = str(info.value)
        assert f"0x{seg.addr + 16:x}" in message and "ge 8" in message and "last seen 7" in message
        assert atomics.load(seg.addr + 16) == 7


def test_wait_until_returns_at_once_when_satisfied_and_checks_once_with_zero_timeout() -> None:
    with HostSegment.create(4096) as seg:
        atomics.store(seg.addr, 5)
        for cmp, value in [("eq", 5), ("ne", 4), ("gt", 4), ("ge", 5), ("lt", 6), ("le", 5)]:
            assert atomics.wait_until(seg.addr, cmp, value, timeout=0) == 5
        for cmp, value in [("eq", 4), ("ne", 5), ("gt", 5), ("ge", 6), ("lt", 5), ("le", 4)]:
            with pytest.raises(TimeoutError):
                atomics.wait_until(seg.addr, cmp, value, timeout=0)


def test_wait_until_signed_comparison() -> None:
    with HostSegment.create(4096) as seg:
        atomics.store(seg.addr, -5, width=32)
        assert atomics.wait_until(seg.addr, "lt", 0, timeout=0, width=32, signed=True) == -5
        with pytest.raises(TimeoutError, match="last seen 4294967291"):
            atomics.wait_until(seg.addr, "lt", 0, timeout=0, width=32)


def _store_later(fd_path: str, size: int, offset: int, value: int, delay: float) -> int:
    seg = _attach(fd_path, size)
    try:
        time.sleep(delay)
        atomics.store(seg.addr + offset, value)
        return os.getpid()
    finally:
        seg.close()


def test_wait_until_wakes_when_another_process_stores() -> None:
    with HostSegment.create(4096) as seg:
        waiter = threading.Thread(
            target=lambda: run_procs(_store_later, [(_proc_path(seg), seg.size, 24, 0xDEAD_BEEF_F00D, 0.5)])
        )
        waiter.start()
        try:
            assert atomics.wait_until(seg.addr + 24, "eq", 0xDEAD_BEEF_F00D, timeout=60) == 0xDEAD_BEEF_F00D
        finally:
            waiter.join(timeout=60)


def test_wait_until_releases_the_gil() -> None:
    with HostSegment.create(4096) as seg:
        # If wait_until held the GIL this thread could not run and the wait would time out.
        t = threading.Timer(0.1, atomics.store, args=(seg.addr, 42))
        t.start()
        try:
            assert atomics.wait_until(seg.addr, "eq", 42, timeout=30) == 42
        finally:
            t.join()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda a: atomics.load(0), ValueError, "null address"),
        (lambda a: atomics.fetch_add(a + 4, 1), ValueError, "not 8-byte aligned"),
        (lambda a: atomics.fetch_add(a + 2, 1, width=32), ValueError, "not 4-byte aligned"),
        (lambda a: atomics.store(a, 1, width=16), ValueError, "32 or 64"),
        (lambda a: atomics.load(a, width=8), ValueError, "32 or 64"),
        (lambda a: atomics.store(a, 1 << 32, width=32), ValueError, "does not fit in 32 bits"),
        (lambda a: atomics.store(a, -(1 << 63) - 1), ValueError, "does not fit in 64 bits"),
        (lambda a: atomics.compare_swap(a, 0, 1 << 64), ValueError, "desired"),
        (lambda a: atomics.store(a, 1.5), TypeError, "int"),
        (lambda a: atomics.wait_until(a, "gte", 1, timeout=1), ValueError, "comparison 'gte' is not one of"),
        (lambda a: atomics.wait_until(a, "eq", 1, timeout=-1), ValueError, "timeout"),
        (lambda a: atomics.wait_until(a, "eq", 1, timeout=math.nan), ValueError, "timeout"),
        (lambda a: atomics.wait_until(a, "eq", 1, timeout=math.inf), ValueError, "timeout"),
        (lambda a: atomics.wait_until(a + 1, "eq", 1, timeout=1), ValueError, "aligned"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error, match) -> None:  # type: ignore[no-untyped-def]
    with HostSegment.create(4096) as seg:
        payload = os.urandom(4096)
        seg.view()[:] = payload
        with pytest.raises(error, match=match):
            call(seg.addr)
        assert bytes(seg.view()) == payload
