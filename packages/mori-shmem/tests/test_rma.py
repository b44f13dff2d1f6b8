"""Host-initiated RMA between real PE processes: data byte for byte, atomics, signals, waits, errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pe_pool import PePool

import mori.shmem as shmem

SLOT = 1 << 16  # bytes each PE owns in the test buffer


def pe_put_ring(seed: int, nbytes: int, offset: int) -> tuple[bytes, bytes]:
    """PE r puts random bytes into slot r of PE r+1; returns (what it sent, what it received)."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    buf = shmem.shmem_malloc(SLOT * n + offset)
    shmem.shmem_barrier_all()
    mine = np.random.default_rng(seed * 1000 + me).integers(0, 256, nbytes, dtype=np.uint8)
    shmem.shmem_putmem(buf + offset + me * SLOT, mine, (me + 1) % n)
    shmem.shmem_barrier_all()
    left = (me - 1) % n
    got = shmem.shmem_getmem(buf + offset + left * SLOT, nbytes, me)
    shmem.shmem_barrier_all()
    shmem.shmem_free(buf)
    return mine.tobytes(), got


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31), st.integers(0, SLOT), st.integers(0, 255))
def test_put_ring(pool: PePool, seed: int, nbytes: int, offset: int) -> None:
    results = pool.run(pe_put_ring, seed, nbytes, offset)
    for r, (_, got) in enumerate(results):
        assert got == results[(r - 1) % pool.n][0]


def pe_get_all(nbytes: int) -> tuple[bytes, list[bytes]]:
    """Every PE fills its buffer with random bytes; then reads every PE's buffer (bytes and into arrays)."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    buf = shmem.shmem_malloc(nbytes)
    mine = os.urandom(nbytes)
    shmem.shmem_putmem(buf, mine, me)
    shmem.shmem_barrier_all()
    seen = []
    for pe in range(n):
        out = np.empty(nbytes, dtype=np.uint8)
        shmem.shmem_getmem_into(out, buf, pe)
        assert out.tobytes() == shmem.shmem_getmem(buf, nbytes, pe)
        seen.append(out.tobytes())
    shmem.shmem_barrier_all()
    shmem.shmem_free(buf)
    return mine, seen


def test_get_from_every_pe(pool: PePool) -> None:
    results = pool.run(pe_get_all, 100_003)
    everyone = [mine for mine, _ in results]
    for _, seen in results:
        assert seen == everyone


def pe_signal_pipeline(rounds: int, nbytes: int) -> list[bytes]:
    """PE r streams `rounds` messages to PE r+1, each announced by a signal (SET then ADD)."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    data = shmem.shmem_malloc(nbytes * rounds)
    sig_set, sig_add = shmem.shmem_malloc(8), shmem.shmem_malloc(8)
    for s in (sig_set, sig_add):
        shmem.shmem_atomic_set(s, 0, me)
    shmem.shmem_barrier_all()
    sent = []
    for k in range(rounds):
        msg = os.urandom(nbytes)
        sent.append(msg)
        op, sig, val = (shmem.SHMEM_SIGNAL_SET, sig_set, k + 1) if k % 2 == 0 else (shmem.SHMEM_SIGNAL_ADD, sig_add, 1)
        shmem.shmem_putmem_signal(data + k * nbytes, msg, sig, val, op, (me + 1) % n)
    # Every message is visible once its signal is: wait for the last of each kind.
    shmem.shmem_wait_until(sig_set, shmem.SHMEM_CMP_GE, rounds - (rounds + 1) % 2, timeout=30)
    shmem.shmem_wait_until(sig_add, "eq", rounds // 2, timeout=30)
    got = shmem.shmem_getmem(data, nbytes * rounds, me)
    shmem.shmem_barrier_all()
    for p in (data, sig_set, sig_add):
        shmem.shmem_free(p)
    return [b"".join(sent), got]


def test_put_signal_wait(pool: PePool) -> None:
    results = pool.run(pe_signal_pipeline, 9, 4099)
    for r, (_, got) in enumerate(results):
        assert got == results[(r - 1) % pool.n][0]


def pe_atomics(width: int) -> list[int]:
    """All PEs fetch-add on PE 0; then compare-swap and swap races; returns what each saw."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    words = shmem.shmem_malloc(64)
    shmem.shmem_putmem(words, bytes(64), me)
    shmem.shmem_barrier_all()
    olds = [shmem.shmem_atomic_fetch_add(words, me + 1, 0, width=width) for _ in range(50)]
    shmem.shmem_barrier_all()
    total = shmem.shmem_atomic_fetch(words, 0, width=width)
    # Exactly one PE wins the compare-swap from 0 to its rank + 1.
    won = shmem.shmem_atomic_compare_swap(words + 8, 0, me + 1, 0, width=width) == 0
    shmem.shmem_barrier_all()
    winner = shmem.shmem_atomic_fetch(words + 8, 0, width=width)
    swapped = shmem.shmem_atomic_swap(words + 16, me + 100, 0, width=width)
    shmem.shmem_barrier_all()
    last = shmem.shmem_atomic_fetch(words + 16, 0, width=width)
    # Wrap-around: -1 is the all-ones word.
    wrap = shmem.shmem_atomic_fetch_add(words + 24, -1, me, width=width)
    wrapped = shmem.shmem_atomic_fetch(words + 24, me, width=width)
    shmem.shmem_barrier_all()
    shmem.shmem_free(words)
    return [*olds, total, int(won), winner, swapped, last, wrap, wrapped, n]


@pytest.mark.parametrize("width", [32, 64])
def test_atomics(pool: PePool, width: int) -> None:
    results = pool.run(pe_atomics, width)
    n = pool.n
    olds = [r[:50] for r in results]
    total, winners = results[0][50], [r[52] for r in results]
    assert total == 50 * sum(range(1, n + 1))
    # Fetch-add results are distinct and every PE saw its own increments in order.
    flat = sorted(o for per_pe in olds for o in per_pe)
    assert len(set(flat)) == len(flat)
    for per_pe in olds:
        assert per_pe == sorted(per_pe)
    assert sum(r[51] for r in results) == 1 and len(set(winners)) == 1
    assert 1 <= winners[0] <= n and results[winners[0] - 1][51] == 1
    swapped = sorted(r[53] for r in results)
    assert swapped.count(0) == 1 and results[0][54] in {100 + r for r in range(n)}
    assert all(r[55] == 0 and r[56] == (1 << width) - 1 for r in results)


def pe_wait_every_cmp() -> list[int]:
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    word = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(word, 10, me)
    shmem.shmem_barrier_all()
    seen = [
        shmem.shmem_wait_until(word, cmp, val, timeout=5)
        for cmp, val in (
            (shmem.SHMEM_CMP_EQ, 10),
            (shmem.SHMEM_CMP_NE, 3),
            (shmem.SHMEM_CMP_GT, 9),
            (shmem.SHMEM_CMP_GE, 10),
            (shmem.SHMEM_CMP_LT, 11),
            (shmem.SHMEM_CMP_LE, 10),
        )
    ]
    shmem.shmem_barrier_all()
    # Now a peer moves the word later: the wait sees the change.
    if me == 0:
        for pe in range(1, n):
            shmem.shmem_atomic_set(word, 77, pe)
    else:
        seen.append(shmem.shmem_wait_until(word, "eq", 77, timeout=30))
    shmem.shmem_barrier_all()
    shmem.shmem_free(word)
    return seen


def test_wait_until_all_comparisons(pool: PePool) -> None:
    results = pool.run(pe_wait_every_cmp)
    assert results[0] == [10] * 6
    assert all(r == [10] * 6 + [77] for r in results[1:])


def pe_wait_timeout() -> str:
    word = shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(word, 5, shmem.shmem_mype())
    try:
        shmem.shmem_wait_until(word, "gt", 5, timeout=0.3)
        return "returned"
    except TimeoutError as exc:
        return str(exc)
    finally:
        shmem.shmem_free(word)


def test_wait_until_timeout(pool: PePool) -> None:
    for msg in pool.run(pe_wait_timeout):
        assert "gt 5" in msg and "last seen 5" in msg


def pe_bad_calls() -> list[str]:
    """Each bad call must raise and leave the heap untouched."""
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    buf = shmem.shmem_malloc(256)
    info = shmem.shmem_heap_info()
    end = int(info["base"], 16) + info["size"]
    shmem.shmem_putmem(buf, b"\x5a" * 256, me)
    shmem.shmem_barrier_all()
    calls = [
        lambda: shmem.shmem_putmem(end - 8, b"x" * 16, me),  # runs past the heap
        lambda: shmem.shmem_putmem(12345, b"x", me),  # not a heap address
        lambda: shmem.shmem_putmem(buf, b"x", n),  # PE out of range
        lambda: shmem.shmem_putmem(buf, "text", me),  # not bytes
        lambda: shmem.shmem_getmem_into(b"readonly", buf, me),  # read-only destination
        lambda: shmem.shmem_atomic_fetch_add(buf + 4, 1, me),  # misaligned 64-bit word
        lambda: shmem.shmem_atomic_fetch_add(buf, 1 << 64, me),  # value too wide
        lambda: shmem.shmem_atomic_fetch_add(buf, 1, me, width=16),  # width
        lambda: shmem.shmem_putmem_signal(buf, b"y" * 8, buf + 3, 1, 0, me),  # misaligned signal
        lambda: shmem.shmem_putmem_signal(buf, b"y" * 8, buf + 8, 1, 7, me),  # bad signal op
        lambda: shmem.shmem_wait_until(buf, "approx", 1, timeout=1),  # bad comparison
        lambda: shmem.shmem_free(buf + 256),  # not an allocation start
    ]
    errors = []
    for call in calls:
        try:
            call()
            errors.append("accepted")
        except (ValueError, TypeError) as exc:
            errors.append(type(exc).__name__)
    intact = shmem.shmem_getmem(buf, 256, me) == b"\x5a" * 256
    shmem.shmem_barrier_all()
    shmem.shmem_free(buf)
    return [*errors, str(intact)]


def test_bad_input_changes_nothing(pool: PePool) -> None:
    for result in pool.run(pe_bad_calls):
        assert "accepted" not in result[:-1], result
        assert result[-1] == "True"


def pe_address_error_message() -> str:
    try:
        shmem.shmem_putmem(8, b"abc", 0)
    except shmem.ShmemAddressError as exc:
        return str(exc)
    return "accepted"


def test_address_error_names_the_heap(pool: PePool) -> None:
    for msg in pool.run(pe_address_error_message):
        assert "outside the symmetric heap" in msg and "0x8" in msg


def pe_quiet_fence() -> bytes:
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    buf = shmem.shmem_malloc(1024)
    payload = os.urandom(1024)
    shmem.shmem_putmem(buf, payload, (me + 1) % n)
    shmem.shmem_fence()
    shmem.shmem_quiet()
    shmem.shmem_barrier_all()
    got = shmem.shmem_getmem(buf, 1024, me)
    shmem.shmem_barrier_all()
    shmem.shmem_free(buf)
    return payload + got


def test_quiet_and_fence(pool: PePool) -> None:
    results = pool.run(pe_quiet_fence)
    for r, res in enumerate(results):
        assert res[1024:] == results[(r - 1) % pool.n][:1024]
