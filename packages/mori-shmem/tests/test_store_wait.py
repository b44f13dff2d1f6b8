"""A GPU heap's host ``wait_until`` on the remote transport's store log (``GpuHeap._wait_on_stores``
over mori-core's ``UcxEngine.store_mark``/``next_store``), with host memory standing in for the
GPU word: two real UCX engines, the target's handlers writing the word for the initiator's
atomics and signal puts. A write through the engine ends the wait at once; a write by anyone else
is caught by the reads of the word between pauses; a write that does not satisfy the condition
does not end it; a waiter whose writes left the log reads the word; nothing is a timeout. The same
wait on GPU memory runs in ci/device/netns_bench.sh (the host's put+signal ping-pong)."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from mori.core import ucx
from mori.core.codes import Cmp
from mori.core.ucx_atomic import atomic, signal_put
from mori.shmem._heap_gpu import GpuHeap


class Target:
    """Engine ``b`` with 8 host words registered as memory 1, and ``a`` connected to it."""

    def __init__(self) -> None:
        self.a = ucx.make_engine("store-wait-a", timeout=10.0)
        self.b = ucx.make_engine("store-wait-b", timeout=10.0)
        self.words = (ctypes.c_uint64 * 8)()
        self.addr = ctypes.addressof(self.words)
        self.b.register_memory(1, self.addr, ctypes.sizeof(self.words))
        self.peer = self.a.connect("b", self.b.addresses, self.b.admit("a"))
        self.reads = 0

    def reader(self, index: int, cmp: Cmp, value: int, seen: list[int]) -> Callable[[], bool]:
        """The heap's read of word ``index`` (counted), as ``wait_until``'s copy out would do it."""

        def holds() -> bool:
            self.reads += 1
            seen[0] = self.words[index]
            return cmp.holds(seen[0], value)

        return holds

    def wait(self, index: int, cmp: Cmp, value: int, timeout: float) -> tuple[bool, int]:
        seen = [0]
        ok = GpuHeap._wait_on_stores(
            self.b, self.reader(index, cmp, value, seen), seen, self.addr + 8 * index, cmp, value, 64,
            time.monotonic() + timeout,
        )  # fmt: skip
        return ok, seen[0]

    def close(self) -> None:
        self.peer.close()
        self.a.close()
        self.b.close()


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target()
    try:
        yield t
    finally:
        t.close()


def later(seconds: float, fn: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_signal_through_the_engine_ends_the_wait_from_the_log(target: Target) -> None:
    src = (ctypes.c_uint8 * 8)(*range(8))
    thread = later(0.2, lambda: signal_put(target.a, target.peer, 1, 48, ctypes.addressof(src), 8, 1, 8, "store", 5))
    start = time.monotonic()
    ok, seen = target.wait(1, Cmp.EQ, 5, 10.0)
    thread.join()
    assert ok and seen == 5 and target.words[1] == 5 and bytes(target.words)[48:56] == bytes(range(8))
    # 200 ms of waiting took a few hundred reads at most (pauses up to 1 ms), not one per microsecond.
    assert time.monotonic() - start < 5 and target.reads < 400


def test_a_write_that_does_not_satisfy_the_condition_does_not_end_it(target: Target) -> None:
    def adds() -> None:
        atomic(target.a, target.peer, "fetch_add", 1, 16, 1)  # 1: not yet
        time.sleep(0.05)
        atomic(target.a, target.peer, "fetch_add", 1, 16, 2)  # 3

    thread = later(0.05, adds)
    ok, seen = target.wait(2, Cmp.GE, 3, 10.0)
    thread.join()
    assert ok and seen == 3


def test_a_write_by_anyone_else_is_caught_by_the_reads(target: Target) -> None:
    def store() -> None:
        target.words[3] = 9  # not through the engine: a kernel's or a P2P peer's write stands in

    thread = later(0.05, store)
    start = time.monotonic()
    ok, seen = target.wait(3, Cmp.EQ, 9, 10.0)
    thread.join()
    assert ok and seen == 9 and time.monotonic() - start < 5


def test_a_waiter_whose_writes_left_the_log_reads_the_word(target: Target) -> None:
    def flood() -> None:
        for i in range(300):  # more than the log keeps, into another word
            atomic(target.a, target.peer, "store", 1, 40, i)
        target.words[4] = 1  # (not logged) the word itself, read once the waiter sees it lost its place

    thread = later(0.0, flood)
    ok, seen = target.wait(4, Cmp.EQ, 1, 10.0)
    thread.join()
    assert ok and seen == 1


def test_nothing_is_a_timeout_near_the_deadline(target: Target) -> None:
    start = time.monotonic()
    ok, seen = target.wait(5, Cmp.EQ, 1, 0.1)
    assert not ok and seen == 0 and 0.09 < time.monotonic() - start < 2
