"""The UCX engine's remote atomics and signal puts (csrc/ucx/atomic.cpp, mori.core.ucx_atomic): every
operation at both widths against a second engine's registered memory, the old values and the words
checked; signal puts' data and signal; the target's refusals (outside the region, misaligned,
unknown or deregistered memory) change no byte; bad arguments and a closed peer fail clearly. Across processes and network namespaces they
run under mori.shmem's remote transport (packages/mori-shmem/tests/test_remote.py)."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mori.core import ucx
from mori.core.ucx_atomic import MAX_SIGNAL_PUT_BYTES, OPS, atomic, signal_put


class Pair:
    """Initiator engine ``a`` connected to target engine ``b``, which registers ``words`` as id 1."""

    def __init__(self) -> None:
        self.a = ucx.make_engine("atomic-a", timeout=10.0)
        self.b = ucx.make_engine("atomic-b", timeout=10.0)
        self.words = (ctypes.c_uint64 * 8)()
        self.addr = ctypes.addressof(self.words)
        self.b.register_memory(1, self.addr, ctypes.sizeof(self.words))
        self.peer = self.a.connect("b", self.b.addresses, self.b.admit("a"))

    def __call__(self, op: str, offset: int, value: int, compare: int = 0, width: int = 64, mem_id: int = 1) -> int:
        return atomic(self.a, self.peer, op, mem_id, offset, value, compare, width, 10.0)

    def close(self) -> None:
        self.peer.close()
        self.a.close()
        self.b.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def test_every_operation_at_both_widths(pair: Pair) -> None:
    w = pair.words
    w[0] = 0
    assert pair("fetch_add", 0, 5) == 0 and pair("fetch_add", 0, 7) == 5 and w[0] == 12
    assert pair("compare_swap", 0, 99, compare=1) == 12 and w[0] == 12  # no match: unchanged
    assert pair("compare_swap", 0, 99, compare=12) == 12 and w[0] == 99
    assert pair("swap", 0, (1 << 64) - 1) == 99 and w[0] == (1 << 64) - 1
    assert pair("fetch_add", 0, 2) == (1 << 64) - 1 and w[0] == 1  # wraps
    assert pair("store", 0, 42) == 1 and w[0] == 42
    w[1] = 0
    # 32-bit words at offsets 8 and 12: each changes alone.
    assert pair("store", 8, 0xFFFFFFFF, width=32) == 0
    assert pair("fetch_add", 8, 3, width=32) == 0xFFFFFFFF and pair("fetch_add", 12, 1, width=32) == 0
    assert w[1] == (1 << 32) | 2
    assert pair("compare_swap", 12, 9, compare=1, width=32) == 1 and w[1] == (9 << 32) | 2
    w[0] = 0b1100
    assert pair("fetch_and", 0, 0b1010) == 0b1100 and w[0] == 0b1000
    assert pair("fetch_or", 0, 0b0011) == 0b1000 and w[0] == 0b1011
    assert pair("fetch_xor", 0, 0b1111) == 0b1011 and w[0] == 0b0100
    w[1] = (7 << 32) | 0xF0
    assert pair("fetch_xor", 8, 0xFF, width=32) == 0xF0 and w[1] == (7 << 32) | 0x0F  # the other half unchanged
    assert pair("fetch_and", 12, 2, width=32) == 7 and pair("fetch_or", 12, 8, width=32) == 2
    assert w[1] == (10 << 32) | 0x0F
    assert set(OPS) == {"fetch_add", "compare_swap", "swap", "store", "fetch_and", "fetch_or", "fetch_xor"}


def test_remote_adds_racing_local_ones_lose_none(pair: Pair) -> None:
    """The target applies an atomic with a compare-and-swap loop: adds from the engine racing the
    process's own atomic adds on the same words (a CPU heap's counter, both widths) all land, and
    the store log ends at the word's final value."""
    from mori.core import atomics

    w, n = pair.words, 400
    w[2] = 0
    w[3] = 0
    stop, local_adds = threading.Event(), [0]

    def add_locally() -> None:  # until the engine's adds are done: they run side by side throughout
        while not stop.is_set():
            atomics.fetch_add(pair.addr + 16, 1, 64)
            atomics.fetch_add(pair.addr + 28, 1, 32)
            local_adds[0] += 1

    local = threading.Thread(target=add_locally)
    local.start()
    try:
        olds = [(pair("fetch_add", 16, 1 << 20), pair("fetch_add", 28, 1 << 20, width=32)) for _ in range(n)]
    finally:
        stop.set()
        local.join()
    assert local_adds[0] > 0
    assert w[2] == n * (1 << 20) + local_adds[0]
    assert w[3] >> 32 == n * (1 << 20) + local_adds[0]
    assert len({o for o, _ in olds}) == n and len({o for _, o in olds}) == n  # each saw a different word
    mark = pair.b.store_mark()
    assert pair("fetch_add", 16, 0) == w[2]
    assert pair.b.next_store(pair.addr + 16, 64, mark, 5.0)[0] == w[2]  # logged as it left the word


@pytest.mark.parametrize(
    ("offset", "width", "mem_id", "reason"),
    [
        (64, 64, 1, "out of range"),  # one word past the region
        (60, 64, 1, "out of range"),  # straddles its end
        (4, 64, 1, "not aligned"),
        (2, 32, 1, "not aligned"),
        (0, 64, 2, "not registered"),
        ((1 << 64) - 8, 64, 1, "out of range"),  # offset arithmetic must not wrap
    ],
)
def test_refusals_change_nothing(pair: Pair, offset: int, width: int, mem_id: int, reason: str) -> None:
    before = bytes(pair.words)
    refused = pair.b.stats()["refused"]
    with pytest.raises(ValueError, match=reason):
        pair("store", offset, 0xABCD, width=width, mem_id=mem_id)
    assert bytes(pair.words) == before and pair.b.stats()["refused"] == refused + 1


def test_deregistered_memory_is_refused() -> None:
    p = Pair()
    try:
        p("store", 0, 7)
        assert p.b.deregister_memory(1)
        with pytest.raises(ValueError, match="not registered"):
            p("store", 0, 8)
        assert p.words[0] == 7
    finally:
        p.close()


def test_bad_arguments_and_a_closed_peer() -> None:
    p = Pair()
    try:
        with pytest.raises(ValueError, match="op must be one of"):
            p("add", 0, 1)
        with pytest.raises(ValueError, match="width must be 32 or 64"):
            p("store", 0, 1, width=16)
        with pytest.raises(ValueError, match="fit in 32 bits"):
            p("store", 0, 1 << 32, width=32)
        with pytest.raises(ValueError, match="timeout must be > 0"):
            atomic(p.a, p.peer, "store", 1, 0, 1, timeout=0)
        other = ucx.make_engine("atomic-other")
        try:
            with pytest.raises(ValueError, match="belongs to another engine"):
                atomic(other, p.peer, "store", 1, 0, 1)
        finally:
            other.close()
        p.peer.close()
        with pytest.raises(RuntimeError, match="cannot be reached"):
            p("store", 0, 1)
    finally:
        p.close()


def test_signal_put_writes_then_signals(pair: Pair) -> None:
    w = pair.words
    w[0], w[7] = 0, 5
    data = (ctypes.c_uint64 * 3)(11, 12, 13)
    signal_put(pair.a, pair.peer, 1, 8, ctypes.addressof(data), 24, 1, 56, "fetch_add", 2, 10.0)
    assert list(w[1:4]) == [11, 12, 13] and w[7] == 7
    signal_put(pair.a, pair.peer, 1, 32, ctypes.addressof(data), 0, 1, 56, "store", 99, 10.0)  # no data
    assert w[7] == 99 and w[4] == 0
    big = (ctypes.c_char * MAX_SIGNAL_PUT_BYTES)()
    with pytest.raises(ValueError, match="at most"):
        signal_put(pair.a, pair.peer, 1, 0, ctypes.addressof(big), MAX_SIGNAL_PUT_BYTES + 1, 1, 56, "store", 1)
    with pytest.raises(ValueError, match="store or fetch_add"):
        signal_put(pair.a, pair.peer, 1, 0, ctypes.addressof(data), 8, 1, 56, "swap", 1)


@pytest.mark.parametrize(
    ("offset", "size", "sig_offset", "reason"),
    [
        (48, 24, 56, "out of range"),  # the data runs past the region
        (0, 8, 52, "not aligned"),  # the signal is misaligned: the data is not written either
        (0, 8, 64, "out of range"),  # the signal is outside the region
    ],
)
def test_signal_put_refusals_write_nothing(pair: Pair, offset: int, size: int, sig_offset: int, reason: str) -> None:
    data = (ctypes.c_char * 24)(*b"Z" * 24)
    before = bytes(pair.words)
    with pytest.raises(ValueError, match=reason):
        signal_put(pair.a, pair.peer, 1, offset, ctypes.addressof(data), size, 1, sig_offset, "store", 1, 10.0)
    assert bytes(pair.words) == before


def test_the_store_log_gives_each_write_of_a_word_in_order(pair: Pair) -> None:
    """UcxEngine.store_mark/next_store: every word the target's handlers wrote (atomics' new values,
    signal puts' signals), in order, for that word and width only; nothing more: a timeout."""
    w, base = pair.words, pair.addr
    w[0] = w[1] = 0
    mark = pair.b.store_mark()
    pair("fetch_add", 0, 5)
    pair("store", 8, 3, width=32)  # another word and width: not the waiter's
    pair("compare_swap", 0, 9, compare=5)
    src = (ctypes.c_uint8 * 8)(*range(8))
    signal_put(pair.a, pair.peer, 1, 24, ctypes.addressof(src), 8, 1, 0, "fetch_add", 2)
    seen = []
    since = mark
    for _ in range(3):
        value, since, lost = pair.b.next_store(base, 64, since, 1.0)
        assert not lost
        seen.append(value)
    assert seen == [5, 9, 11] and w[0] == 11
    assert pair.b.next_store(base + 8, 32, mark, 0.0) == (3, mark + 2, False)
    mark32 = pair.b.store_mark()
    pair("store", 12, 0xFFFFFFFF, width=32)
    pair("fetch_add", 12, 2, width=32)  # wraps within its 32 bits, as the log says
    first, since32, _ = pair.b.next_store(base + 12, 32, mark32, 1.0)
    assert (first, pair.b.next_store(base + 12, 32, since32, 1.0)[0]) == (0xFFFFFFFF, 1) and w[1] >> 32 == 1
    start = time.monotonic()
    assert pair.b.next_store(base, 64, since, 0.05) == (None, pair.b.store_mark(), False)  # past the others
    assert 0.04 < time.monotonic() - start < 5


def test_a_waiter_on_the_store_log_wakes_at_the_signal(pair: Pair) -> None:
    pair.words[2] = 0
    mark = pair.b.store_mark()
    out: list[tuple[int | None, int, bool]] = []
    waiter = threading.Thread(target=lambda: out.append(pair.b.next_store(pair.addr + 16, 64, mark, 10.0)))
    waiter.start()
    time.sleep(0.05)  # the waiter sleeps by now
    src = (ctypes.c_uint8 * 4)(1, 2, 3, 4)
    start = time.monotonic()
    signal_put(pair.a, pair.peer, 1, 40, ctypes.addressof(src), 4, 1, 16, "store", 77)
    waiter.join(10)
    assert out and out[0][0] == 77 and not out[0][2] and time.monotonic() - start < 5


def test_a_waiter_that_fell_behind_the_store_log_is_told(pair: Pair) -> None:
    from mori.core._native.ucx import UcxEngine

    mark = pair.b.store_mark()
    for i in range(300):  # more than the log keeps
        pair("store", 32, i)
    value, since, lost = pair.b.next_store(pair.addr + 32, 64, mark, 0.0)
    assert lost and value is None and since == pair.b.store_mark()
    assert UcxEngine.next_store.__doc__ and "256" in UcxEngine.next_store.__doc__
    with pytest.raises(ValueError, match="width"):
        pair.b.next_store(pair.addr, 16, mark, 0.0)
    with pytest.raises(ValueError, match="timeout"):
        pair.b.next_store(pair.addr, 64, mark, -1.0)


def test_MORI_TRACE_DIR_timestamps_a_signal_puts_steps(tmp_path) -> None:
    """csrc/base/trace.hpp: with MORI_TRACE_DIR set, a process records each signal put's steps
    (initiator H ... Y h, target R ... A) in one file of fixed records, in time order; ci/trace_report.py
    reads them. A child process: the first mark of a process decides whether it records."""
    script = (
        "import ctypes\n"
        "from mori.core import ucx\n"
        "from mori.core.ucx_atomic import signal_put\n"
        "a, b = ucx.make_engine('trace-a', timeout=10.0), ucx.make_engine('trace-b', timeout=10.0)\n"
        "words = (ctypes.c_uint64 * 4)()\n"
        "b.register_memory(1, ctypes.addressof(words), 32)\n"
        "peer = a.connect('b', b.addresses, b.admit('a'))\n"
        "src = ctypes.c_uint64(7)\n"
        "for i in range(3):\n"
        "    signal_put(a, peer, 1, 8, ctypes.addressof(src), 8, 1, 0, 'store', i + 1)\n"
        "assert words[0] == 3 and words[1] == 7\n"
        "peer.close(); a.close(); b.close()\n"
    )
    env = {**os.environ, "MORI_TRACE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    (path,) = tmp_path.glob("mori-trace-*.bin")
    data = path.read_bytes()
    records = [struct.unpack_from("<QQQ", data, i) for i in range(0, 24 * 64, 24)]
    steps = "".join(chr(step) for ns, step, _ in records if ns)
    assert steps.count("H") == 3 and steps.count("h") == 3 and steps.count("R") == 3 and steps.count("A") == 3
    for i in range(3):  # each put's steps in order: posted, handled, answered, its answer received, returned
        one = steps.split("H")[i + 1]
        assert one.index("R") < one.index("A") < one.index("h") and "Y" in one
    times = [ns for ns, _, _ in records if ns]
    assert times == sorted(times)
    report = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[3] / "ci" / "trace_report.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert report.returncode == 0 and "15 records from 1 processes" in report.stdout, report.stdout + report.stderr


def test_serving_gpu_memory_needs_every_driver_entry_point() -> None:
    """``ucx_serve_gpu`` takes the driver's entry points by name (one table, UCX_GPU_ENTRY_POINTS,
    the asynchronous copies' completion words among them) and refuses a table missing one, naming it,
    before the engine changes (nothing here is called: the addresses are never used)."""
    from mori.core._native.ucx import UCX_GPU_ENTRY_POINTS, ucx_serve_gpu

    assert {"cuStreamWriteValue32", "cuMemHostGetDevicePointer", "cuStreamQuery", "cuMemcpyDtoHAsync"} <= set(
        UCX_GPU_ENTRY_POINTS
    )
    assert len(set(UCX_GPU_ENTRY_POINTS)) == len(UCX_GPU_ENTRY_POINTS)
    engine = ucx.make_engine("gpu-entry-points")
    try:
        points = {name: 0x1000 + i for i, name in enumerate(UCX_GPU_ENTRY_POINTS)}
        del points["cuStreamWriteValue32"]
        with pytest.raises(ValueError, match="entry_points has no cuStreamWriteValue32"):
            ucx_serve_gpu(engine, 1, 1, 1, 1, 1, points, 1, 1 << 20, True)
        points["cuStreamWriteValue32"] = 0
        with pytest.raises(ValueError, match="needs the driver's cuStreamWriteValue32"):
            ucx_serve_gpu(engine, 1, 1, 1, 1, 1, points, 1, 1 << 20, True)
    finally:
        engine.close()
