"""The heap window (csrc/ucx/heap_window.cpp, mori.core.ucx.UcxHeapWindow): the remote side of a
symmetric heap that mori.shmem's host calls and the device proxy both use. PE 0 (engine ``a``,
its heap and the window) reaches PE 1 (engine ``b``, its heap registered as the window registers
PE 0's: four chunks, ids 1..4). Every local case (the heap, a registered buffer, the staging
area, memory registered for the call), transfers cut at the chunks of both sides, puts with
signal and atomics, the plain put and what it leaves to the caller, and the refusals, each
checked byte for byte on PE 1's heap."""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator

import pytest

from mori.core import ucx
from mori.core.codes import TransferCode
from mori.core.memory import LiveRanges
from mori.core.ucx_atomic import OPS

HEAP = 1 << 20
CHUNK = 256 << 10
RESERVED = 4096


class Pair:
    """PE 0's engine, heap and window; PE 1's engine and heap."""

    def __init__(self) -> None:
        self.a = ucx.make_engine("window-a", timeout=10.0)
        self.b = ucx.make_engine("window-b", timeout=10.0)
        self.heaps = [ctypes.create_string_buffer(HEAP) for _ in range(2)]
        for k in range(HEAP // CHUNK):
            self.b.register_memory(1 + k, self.base(1) + k * CHUNK, CHUNK)
        self.peer = self.a.connect("b", self.b.addresses, self.b.admit("a"))
        self.live = LiveRanges()
        self.window = ucx.UcxHeapWindow(
            self.a, self.live, self.base(0), HEAP, RESERVED, CHUNK, 1, False, [None, self.peer], 10.0
        )
        self.window.grow(HEAP)

    def base(self, pe: int) -> int:
        return ctypes.addressof(self.heaps[pe])

    def far(self, offset: int, nbytes: int) -> bytes:
        return self.heaps[1].raw[offset : offset + nbytes]

    def close(self) -> None:
        self.window.close()
        self.peer.close()
        self.a.close()
        self.b.close()


@pytest.fixture()
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.close()


def _bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_a_layout_that_cannot_be_is_refused() -> None:
    engine = ucx.make_engine("window-layout", timeout=1.0)
    try:
        for size, reserved, chunk, why in (
            (4096, 0, 0, "chunk"),
            (4096, 0, 1000, "chunk"),
            (4096, 8192, 4096, "reserved"),
        ):
            with pytest.raises(ValueError, match=why):
                ucx.UcxHeapWindow(engine, LiveRanges(), 1 << 20, size, reserved, chunk, 1, False, [None], 1.0)
        window = ucx.UcxHeapWindow(engine, LiveRanges(), 1 << 20, 4096, 0, 4096, 1, False, [None, None], 1.0)
        assert window.quick_put((1 << 20) + 8, 1 << 20, 8, 0) is None  # no peer for any PE: nothing to do here
        window.close()
    finally:
        engine.close()


def test_every_local_case_moves_every_byte_and_is_counted(pair: Pair) -> None:
    """From and into the heap (cut at both sides' chunks), a registered buffer, the staging area
    (small host memory elsewhere) and memory registered for the call (larger)."""
    w = pair.window
    src = _bytes(1, 2 * CHUNK + 17)
    ctypes.memmove(pair.base(0) + CHUNK - 300, src, len(src))
    assert w.put(1, CHUNK - 100, pair.base(0) + CHUNK - 300, len(src)) is None  # both sides cross two chunks
    assert pair.far(CHUNK - 100, len(src)) == src
    back = ctypes.create_string_buffer(len(src))
    assert w.get(1, CHUNK - 100, ctypes.addressof(back), len(src)) is None  # registered for the call
    assert back.raw == src
    small = ctypes.create_string_buffer(_bytes(2, 4096), 4096)
    assert w.put(1, 3 * CHUNK + 5, ctypes.addressof(small), 4096) is None  # staged
    assert pair.far(3 * CHUNK + 5, 4096) == small.raw
    into = ctypes.create_string_buffer(4096)
    assert w.get(1, 3 * CHUNK + 5, ctypes.addressof(into), 4096) is None
    assert into.raw == small.raw
    assert w.stats() == {"staged": 2, "registered_for_call": 1, "registered_buffers": 0}

    buffer = ctypes.create_string_buffer(_bytes(3, CHUNK + 4096), CHUNK + 4096)
    w.register_buffer(ctypes.addressof(buffer), CHUNK + 4096, False)
    with pytest.raises(ValueError, match="overlaps"):
        w.register_buffer(ctypes.addressof(buffer) + 4096, 10, False)
    assert w.put(1, CHUNK - 8, ctypes.addressof(buffer) + 100, CHUNK) is None  # crosses a remote chunk
    assert w.put(1, 0 + RESERVED, ctypes.addressof(buffer), 100) is None
    assert pair.far(CHUNK - 8, CHUNK) == buffer.raw[100 : CHUNK + 100]
    assert pair.far(RESERVED, 100) == buffer.raw[:100]
    ctypes.memset(ctypes.addressof(buffer), 0, CHUNK + 4096)
    assert w.get(1, CHUNK - 8, ctypes.addressof(buffer), CHUNK) is None
    assert buffer.raw[:CHUNK] == pair.far(CHUNK - 8, CHUNK)
    assert w.stats() == {"staged": 2, "registered_for_call": 1, "registered_buffers": 1}
    assert w.deregister_buffer(ctypes.addressof(buffer)) is True
    assert w.deregister_buffer(ctypes.addressof(buffer)) is False
    assert w.put(1, 0, ctypes.addressof(buffer), 100) is None  # staged again
    assert w.stats() == {"staged": 3, "registered_for_call": 1, "registered_buffers": 0}


def test_the_plain_put_and_what_it_leaves_to_the_caller(pair: Pair) -> None:
    """quick_put: a range in one live block past the reserved bytes, from the heap or a
    registered buffer, to a PE with a peer, is written (chunks crossed too); every other call is
    None and moves nothing; a transfer the target refuses reports its code."""
    w, base = pair.window, pair.base(0)
    pair.live.add(8192, 8192)
    pair.live.add(CHUNK - 100, 300)
    data = _bytes(4, 8192)
    ctypes.memmove(base + CHUNK + 50, data, len(data))
    assert w.quick_put(base + 8192, base + CHUNK + 50, 8192, 1) is True
    assert w.quick_put(base + CHUNK - 100, base + CHUNK + 50, 300, 1) is True  # crosses a chunk
    assert pair.far(8192, 8192) == data and pair.far(CHUNK - 100, 300) == data[:300]
    before = pair.heaps[1].raw
    outside = ctypes.create_string_buffer(64)
    for dest, src, n, pe in [
        (base + 8192 + 8000, base, 400, 1),  # past its block
        (base, base, 16, 1),  # in the reserved bytes (no block there either)
        (base + 8192, ctypes.addressof(outside), 64, 1),  # a source neither in the heap nor registered
        (base + 8192, base + HEAP - 10, 20, 1),  # a source past the heap
        (base + 8192, base, 0, 1),  # nothing to move (the caller's path says so)
        (base + 8192, base, 16, 0),
        (base + 8192, base, 16, 2),
        (base + 8192, base, 16, -1),  # no peer
        (base + 8192, base, 16, True),
        (base + 8192, base, 16, 1.0),
        (-1, base, 16, 1),
        (2**64, base, 16, 1),
        (1.5, base, 16, 1),
        (None, base, 16, 1),  # not an int, or no address
    ]:
        assert w.quick_put(dest, src, n, pe) is None, (dest - base if isinstance(dest, int) else dest, src, n, pe)
    assert pair.heaps[1].raw == before
    pair.b.deregister_memory(1)  # the target no longer serves chunk 0
    code, message = w.quick_put(base + 8192, base + CHUNK + 50, 64, 1)
    assert code == TransferCode.ERR_NOT_FOUND and "not registered" in message, message
    assert pair.heaps[1].raw == before


def test_put_with_signal_and_atomics(pair: Pair) -> None:
    w = pair.window
    sig = ctypes.c_uint64.from_address(pair.base(1) + 2 * CHUNK + 64)
    small, large = _bytes(5, 300), _bytes(6, 40_000)  # one message; the put, then the atomic
    for rnd, data in enumerate((small, large), start=1):
        src = ctypes.create_string_buffer(data, len(data))
        assert (
            w.put_signal(1, CHUNK + 8, ctypes.addressof(src), len(data), False, 2 * CHUNK + 64, OPS["fetch_add"], rnd)
            is None
        )
        assert pair.far(CHUNK + 8, len(data)) == data
    assert sig.value == 3
    assert w.put_signal(1, 0, 0, 0, False, 2 * CHUNK + 64, OPS["store"], 9) is None and sig.value == 9
    off = 3 * CHUNK + 8
    assert w.atomic(1, OPS["fetch_add"], off, 5, 0, 64) == 0
    assert w.atomic(1, OPS["compare_swap"], off, 7, 5, 64) == 5
    assert w.atomic(1, OPS["swap"], off + 8, 0xFFFFFFFF, 0, 32) == 0
    assert ctypes.c_uint64.from_address(pair.base(1) + off).value == 7
    assert ctypes.c_uint32.from_address(pair.base(1) + off + 8).value == 0xFFFFFFFF
    code, message = w.put_signal(1, 0, 0, 0, False, 2 * CHUNK + 64, OPS["swap"], 1)
    assert code == TransferCode.ERR_INVALID_ARGS and "store or fetch_add" in message
    with pytest.raises(ValueError, match="unknown atomic op"):
        w.atomic(1, 99, off, 1, 0, 64)


def test_refusals_name_what_was_wrong_and_move_nothing(pair: Pair) -> None:
    w = pair.window
    before = pair.heaps[1].raw
    src = ctypes.create_string_buffer(64)
    for got, why in [
        (w.put(0, 0, ctypes.addressof(src), 8), "names PE 0, which is not reached"),
        (w.get(5, 0, ctypes.addressof(src), 8), "names PE 5, which is not reached"),
        (w.put(1, HEAP - 4, ctypes.addressof(src), 8), "runs past the heap"),
        (w.put_signal(1, 0, ctypes.addressof(src), 8, False, HEAP, OPS["store"], 1), "runs past the heap"),
        (w.atomic(1, OPS["fetch_add"], HEAP - 4, 1, 0, 64), "runs past the heap"),
    ]:
        assert isinstance(got, tuple) and got[0] == TransferCode.ERR_INVALID_ARGS and why in got[1], got
    code, message = w.atomic(1, OPS["fetch_add"], 12, 1, 0, 64)  # misaligned: the target refuses
    assert code == TransferCode.ERR_INVALID_ARGS and message, message
    assert pair.heaps[1].raw == before
