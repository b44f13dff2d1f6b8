"""The proxy of device-initiated RMA (csrc/proxy/proxy.cpp, mori.core._native.ucx.UcxProxy) on CPU:
this test plays the kernels' part, writing commands into a ring in host memory exactly as
mori/device/proxy.cuh does (a slot free for ticket t holds seq 4t; its fields, then seq 4t + 1),
and checks what the proxy did on a second engine's registered "heap" byte for byte: puts and gets
(from the local heap, from memory outside it, across heap chunks), inline puts, g, every atomic
with its reply (atomics in flight beside each other), puts with signal (their bytes in the command too), fences (ordering per PE),
buffers outside the heap shared by the commands in flight, completion (``completed``), backpressure over a full
ring, a failed command naming its PE, and a clean stop. On GPUs the same proxy runs under
mori.shmem (ci/device/shmem_proxy.sh)."""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Iterator

import pytest

from mori.core import ucx
from mori.core._native.ucx import PROXY_HEADER_BYTES, PROXY_SLOT_BYTES, PROXY_SLOTS, UcxProxy
from mori.core.memory import LiveRanges

HEAP = 1 << 20
CHUNK = 256 << 10  # four chunks: ids 1..4, as a vmm heap registers them
PUT, GET, PUT_INLINE, GET_INLINE, ATOMIC, FENCE = 1, 2, 3, 4, 5, 6
REPLY, ORDERED, SIGNAL, INLINE = 1, 2, 4, 8
FETCH_ADD, COMPARE_SWAP, SWAP, STORE, FETCH_AND, FETCH_OR, FETCH_XOR = 1, 2, 3, 4, 5, 6, 7


class Slot(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("command", ctypes.c_uint32),
        ("pe", ctypes.c_int32),
        ("remote", ctypes.c_uint64),
        ("local", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("compare", ctypes.c_uint64),
        ("op", ctypes.c_uint8),
        ("width", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8 * 5),
    ]


class Header(ctypes.Structure):
    _fields_ = [
        ("slots", ctypes.c_uint64),
        ("completed", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("waitingPe", ctypes.c_uint64),
        ("taken", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 3),
    ]


assert ctypes.sizeof(Slot) == PROXY_SLOT_BYTES and ctypes.sizeof(Header) == PROXY_HEADER_BYTES


class Rig:
    """PE 0 (engine ``a``, its heap and its window, the ring and the proxy) and PE 1 (engine ``b``,
    its heap registered as the window registers PE 0's)."""

    def __init__(self) -> None:
        self.a = ucx.make_engine("proxy-a", timeout=10.0)
        self.b = ucx.make_engine("proxy-b", timeout=10.0)
        self.heaps = [ctypes.create_string_buffer(HEAP) for _ in range(2)]
        for k in range(HEAP // CHUNK):
            self.b.register_memory(1 + k, self.base(1) + k * CHUNK, CHUNK)
        self.peer = self.a.connect("b", self.b.addresses, self.b.admit("a"))
        self.window = ucx.UcxHeapWindow(
            self.a, LiveRanges(), self.base(0), HEAP, 0, CHUNK, 1, False, [None, self.peer], 10.0
        )
        self.window.grow(HEAP)
        self.ring = ctypes.create_string_buffer(PROXY_HEADER_BYTES + PROXY_SLOTS * PROXY_SLOT_BYTES)
        self.bounce = ctypes.create_string_buffer(PROXY_SLOTS * 16)
        self.header = Header.from_address(ctypes.addressof(self.ring))
        self.ticket = 0
        self.proxy = UcxProxy(self.window, ctypes.addressof(self.ring), ctypes.addressof(self.bounce))

    def base(self, pe: int) -> int:
        return ctypes.addressof(self.heaps[pe])

    def slot(self, t: int) -> Slot:
        return Slot.from_address(
            ctypes.addressof(self.ring) + PROXY_HEADER_BYTES + (t % PROXY_SLOTS) * PROXY_SLOT_BYTES
        )

    def post(
        self,
        command: int,
        remote: int = 0,
        local: int = 0,
        nbytes: int = 0,
        value: int = 0,
        compare: int = 0,
        op: int = 0,
        width: int = 64,
        flags: int = 0,
        pe: int = 1,
        timeout: float = 10.0,
    ) -> int:
        """What ProxyPost does: take a ticket, wait for its slot, fill it, publish it."""
        t, self.ticket = self.ticket, self.ticket + 1
        s = self.slot(t)
        deadline = time.monotonic() + timeout
        while s.seq != 4 * t:
            assert time.monotonic() < deadline, f"slot of ticket {t} never freed (seq {s.seq})"
            time.sleep(1e-5)
        s.command, s.pe, s.remote, s.local, s.bytes = command, pe, remote, local, nbytes
        s.value, s.compare, s.op, s.width, s.flags = value, compare, op, width, flags
        s.seq = 4 * t + 1  # x86 stores are not reordered: the fields are visible first
        return t

    def answer(self, t: int) -> int:
        """What ProxyAnswer does: wait for seq 4t + 2, read the reply, free the slot."""
        s = self.slot(t)
        deadline = time.monotonic() + 10
        while s.seq != 4 * t + 2:
            assert time.monotonic() < deadline, f"no answer to ticket {t}"
            time.sleep(1e-5)
        value = int(s.value)
        s.seq = 4 * (t + PROXY_SLOTS)
        return value

    def quiet(self) -> None:
        """What ProxyQuiet does: wait until completed reaches every ticket taken."""
        deadline = time.monotonic() + 10
        while self.header.completed < self.ticket:
            assert time.monotonic() < deadline, f"completed stuck at {self.header.completed} of {self.ticket}"
            time.sleep(1e-5)

    def close(self) -> None:
        self.proxy.stop()
        self.window.close()
        self.peer.close()
        self.a.close()
        self.b.close()


@pytest.fixture()
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def test_puts_and_gets_byte_for_byte(rig: Rig) -> None:
    rng = random.Random(5)
    src = bytes(rng.randrange(256) for _ in range(3 * CHUNK))
    outside = ctypes.create_string_buffer(src, len(src))  # memory outside the heap: registered per command
    ctypes.memmove(rig.base(0) + 4096, src, len(src))
    rig.post(PUT, remote=CHUNK - 100, local=rig.base(0) + 4096, nbytes=2 * CHUNK + 17)  # crosses two chunks
    rig.post(PUT, remote=3 * CHUNK + 8, local=ctypes.addressof(outside), nbytes=CHUNK - 64)
    rig.post(
        PUT_INLINE,
        remote=64,
        nbytes=11,
        value=int.from_bytes(b"hello, p", "little"),
        compare=int.from_bytes(b"roxy\0\0\0\0", "little"),
    )
    rig.quiet()
    far = rig.heaps[1].raw
    assert far[CHUNK - 100 : CHUNK - 100 + 2 * CHUNK + 17] == src[: 2 * CHUNK + 17]
    assert far[3 * CHUNK + 8 : 4 * CHUNK - 56] == src[: CHUNK - 64]
    assert far[64:75] == b"hello, prox"
    back = ctypes.create_string_buffer(2 * CHUNK)
    rig.post(GET, remote=CHUNK - 100, local=ctypes.addressof(back), nbytes=2 * CHUNK)
    rig.post(GET, remote=CHUNK - 100, local=rig.base(0) + 2 * CHUNK, nbytes=CHUNK + 3)
    rig.quiet()
    assert back.raw == src[: 2 * CHUNK]
    assert rig.heaps[0].raw[2 * CHUNK : 3 * CHUNK + 3] == src[: CHUNK + 3]
    t = rig.post(GET_INLINE, remote=64, nbytes=8, flags=REPLY)
    assert rig.answer(t).to_bytes(8, "little") == b"hello, p"
    assert rig.proxy.failure() == "" and rig.header.failed == 0
    assert rig.proxy.wait_idle(5.0)


def test_every_atomic_with_its_reply(rig: Rig) -> None:
    word = ctypes.c_uint64.from_address(rig.base(1) + 2 * CHUNK + 64)  # in the third chunk
    word.value = 10
    off = 2 * CHUNK + 64
    assert rig.answer(rig.post(ATOMIC, remote=off, value=5, op=FETCH_ADD, flags=REPLY)) == 10
    assert rig.answer(rig.post(ATOMIC, remote=off, value=99, compare=1, op=COMPARE_SWAP, flags=REPLY)) == 15
    assert rig.answer(rig.post(ATOMIC, remote=off, value=99, compare=15, op=COMPARE_SWAP, flags=REPLY)) == 15
    assert rig.answer(rig.post(ATOMIC, remote=off, value=0b1111, op=SWAP, flags=REPLY)) == 99
    assert rig.answer(rig.post(ATOMIC, remote=off, value=0b0101, op=FETCH_AND, flags=REPLY)) == 0b1111
    assert rig.answer(rig.post(ATOMIC, remote=off, value=0b1000, op=FETCH_OR, flags=REPLY)) == 0b0101
    assert rig.answer(rig.post(ATOMIC, remote=off, value=0b0001, op=FETCH_XOR, flags=REPLY)) == 0b1101
    rig.post(ATOMIC, remote=off, value=7, op=STORE)  # non-fetching: complete after quiet
    rig.post(ATOMIC, remote=off + 8, value=3, op=FETCH_ADD, width=32)
    rig.quiet()
    assert word.value == 7 and ctypes.c_uint32.from_address(rig.base(1) + off + 8).value == 3


@pytest.mark.parametrize(
    "remote, nbytes",
    [
        (CHUNK + 1000, 16 << 10),  # one message: the bytes travel in the signal's request
        (2 * CHUNK - 5000, 16 << 10),  # across a chunk: the put, complete, then the signal
        (CHUNK + 1000, (16 << 10) + 1),  # over one message's bytes: likewise
    ],
)
def test_put_with_signal(rig: Rig, remote: int, nbytes: int) -> None:
    data = bytes(random.Random(nbytes + remote).randrange(256) for _ in range(nbytes))
    ctypes.memmove(rig.base(0) + 8192, data, len(data))
    sig = ctypes.c_uint64.from_address(rig.base(1) + 128)
    for rnd in range(1, 6):
        ctypes.memmove(rig.base(0) + 8192, bytes([rnd]), 1)  # each round's bytes differ
        rig.post(
            PUT,
            remote=remote,
            local=rig.base(0) + 8192,
            nbytes=nbytes,
            value=rnd,
            compare=128,
            op=FETCH_ADD,
            flags=SIGNAL,
        )
        deadline = time.monotonic() + 10
        while sig.value < rnd * (rnd + 1) // 2:  # the target sees this round's signal: the data is there
            assert time.monotonic() < deadline
        assert rig.heaps[1].raw[remote : remote + nbytes] == bytes([rnd]) + data[1:]
    assert sig.value == sum(range(1, 6))
    rig.quiet()
    assert rig.proxy.failure() == ""


@pytest.mark.parametrize(
    "remote, nbytes",
    [
        (CHUNK + 1000, 8),  # one message
        (CHUNK + 3, 5),  # one message, unaligned
        (2 * CHUNK - 3, 8),  # across a chunk: the put from the slot's bounce area, then the signal
    ],
)
def test_put_with_signal_of_bytes_in_the_command(rig: Rig, remote: int, nbytes: int) -> None:
    sig = ctypes.c_uint64.from_address(rig.base(1) + 128)
    before = rig.heaps[1].raw[remote - 8 : remote + nbytes + 8]
    for rnd in range(1, 6):
        data = bytes(random.Random(rnd * 100 + nbytes).randrange(256) for _ in range(nbytes))
        rig.post(
            PUT,
            remote=remote,
            local=int.from_bytes(data, "little"),  # the bytes, first lowest, as ProxyPutSignal packs them
            nbytes=nbytes,
            value=rnd,
            compare=128,
            op=STORE,
            flags=SIGNAL | INLINE,
        )
        deadline = time.monotonic() + 10
        while sig.value != rnd:  # the target sees this round's signal: the data is there
            assert time.monotonic() < deadline
        assert rig.heaps[1].raw[remote : remote + nbytes] == data
    after = rig.heaps[1].raw[remote - 8 : remote + nbytes + 8]
    assert after[:8] == before[:8] and after[-8:] == before[-8:]  # nothing written beside them
    rig.quiet()
    assert rig.proxy.failure() == ""


@pytest.mark.parametrize("command, nbytes", [(PUT, 0), (PUT, 9), (GET, 8)])
def test_bytes_in_the_command_only_with_a_put_with_signal_of_1_to_8(rig: Rig, command: int, nbytes: int) -> None:
    before = rig.heaps[1].raw[:]
    rig.post(command, remote=1000, local=0x0102030405060708, nbytes=nbytes, value=1, compare=128, flags=SIGNAL | INLINE)
    rig.quiet()  # refused, it still completes and frees its slot
    assert rig.header.failed == 2 and "inline bytes" in rig.proxy.failure()
    assert rig.heaps[1].raw[:] == before
    for i in range(PROXY_SLOTS + 8):  # every slot is free again: the ring goes round
        rig.post(PUT_INLINE, remote=2048, nbytes=8, value=i)
    rig.quiet()
    assert ctypes.c_uint64.from_address(rig.base(1) + 2048).value == PROXY_SLOTS + 7


def test_fence_orders_a_put_before_the_next_command(rig: Rig) -> None:
    # Fence: the put before it is complete at the target before the store after it starts, so
    # whoever sees the flag sees the bytes (the store alone, a small message, would overtake them).
    flag = ctypes.c_uint64.from_address(rig.base(1) + 3 * CHUNK)
    big = 2 * CHUNK + 4096
    for rnd in range(1, 4):
        pattern = bytes((i * rnd) % 251 for i in range(big))
        ctypes.memmove(rig.base(0) + CHUNK, pattern, big)
        rig.post(PUT, remote=0, local=rig.base(0) + CHUNK, nbytes=big)
        rig.post(FENCE, value=2 if rnd % 2 else 0)  # for PE 1 alone (value = 1 + PE), or for every PE
        rig.post(ATOMIC, remote=3 * CHUNK, value=rnd, op=STORE)
        deadline = time.monotonic() + 10
        while flag.value != rnd:
            assert time.monotonic() < deadline, f"flag {flag.value}, round {rnd}"
        assert rig.heaps[1].raw[:big] == pattern
    rig.quiet()
    assert rig.proxy.failure() == ""


def test_atomics_complete_in_the_background_and_quiet_waits_for_them(rig: Rig) -> None:
    # Non-fetching atomics and fetching ones interleaved: the proxy keeps them in flight beside
    # each other; quiet (completed) covers every one, and each answer is its own old value.
    word = ctypes.c_uint64.from_address(rig.base(1) + 640)
    answers = []
    for i in range(200):
        rig.post(ATOMIC, remote=640, value=1, op=FETCH_ADD)
        if i % 50 == 49:
            answers.append(rig.answer(rig.post(ATOMIC, remote=640, value=0, op=FETCH_ADD, flags=REPLY)))
    rig.quiet()
    assert word.value == 200
    # An answer is at least every add posted before it (the adds of one PE arrive in order).
    assert answers == sorted(answers) and all(a >= 50 * (k + 1) for k, a in enumerate(answers))
    assert rig.header.completed == rig.ticket and rig.proxy.failure() == ""


def test_commands_in_one_outside_buffer_share_its_registration(rig: Rig) -> None:
    # Puts from sub-ranges of a buffer outside the heap while the whole buffer's put is in flight
    # (one registration, released with the last of them), and one that reaches past it.
    src = bytes(random.Random(9).randrange(256) for _ in range(CHUNK))
    outside = ctypes.create_string_buffer(src + bytes(4096), CHUNK + 4096)
    base = ctypes.addressof(outside)
    rig.post(PUT, remote=0, local=base, nbytes=CHUNK)
    for k in range(8):
        rig.post(PUT, remote=CHUNK + k * 4096, local=base + k * 8192, nbytes=4096)
    rig.post(PUT, remote=2 * CHUNK, local=base + CHUNK - 100, nbytes=4196)  # past the first registration
    rig.quiet()
    far = rig.heaps[1].raw
    assert far[:CHUNK] == src
    assert all(far[CHUNK + k * 4096 : CHUNK + (k + 1) * 4096] == src[k * 8192 : k * 8192 + 4096] for k in range(8))
    assert far[2 * CHUNK : 2 * CHUNK + 4196] == src[CHUNK - 100 :] + bytes(4096)
    assert rig.proxy.failure() == "" and rig.proxy.wait_idle(5.0)


def test_full_ring_backpressure_loses_nothing(rig: Rig) -> None:
    # More commands than slots, posted as fast as the slots free: every one lands exactly once.
    count = 3 * PROXY_SLOTS + 7
    for i in range(count):
        rig.post(ATOMIC, remote=512, value=1, op=FETCH_ADD)
        rig.post(PUT_INLINE, remote=1024 + 8 * (i % 64), nbytes=8, value=i)
    rig.quiet()
    assert ctypes.c_uint64.from_address(rig.base(1) + 512).value == count
    assert rig.proxy.executed() == 2 * count
    assert rig.header.taken == rig.ticket == rig.header.completed


def test_a_failed_command_names_its_pe_and_still_completes(rig: Rig) -> None:
    t = rig.post(ATOMIC, remote=HEAP - 4, value=1, op=FETCH_ADD, flags=REPLY)  # a 64-bit word past the heap
    assert rig.answer(t) == 0
    assert rig.header.failed == 2 and "PE 1" in rig.proxy.failure()
    rig.post(PUT, remote=0, local=rig.base(0), nbytes=8, pe=0)  # PE 0 is not served by the proxy
    rig.post(PUT, remote=0, local=rig.base(0), nbytes=8, pe=7)
    rig.quiet()  # refused commands still complete: no kernel waits forever
    assert rig.header.failed == 2  # the first failure stays
    assert rig.proxy.wait_idle(5.0)


def test_stop_after_the_commands_posted(rig: Rig) -> None:
    for i in range(50):
        rig.post(PUT_INLINE, remote=2048 + 8 * i, nbytes=8, value=i + 1)
    rig.proxy.stop()
    assert all(ctypes.c_uint64.from_address(rig.base(1) + 2048 + 8 * i).value == i + 1 for i in range(50))
    assert rig.header.completed == rig.ticket == 50
