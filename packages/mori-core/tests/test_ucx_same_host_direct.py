"""The same-host path's direct copies (csrc/same_host/window.hpp): an initiator copies a small
transfer itself, checked against the window of registrations its target publishes, and notes it
there before it reports success; the target's deregistration waits for the pins of live
initiators only; what the window cannot check goes to the target's thread, which refuses it as
before. Raw clients here map the window and pins as any process on the host could."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import socket
import struct
import threading
import time
from typing import Any

import _same_host_client as sh
import numpy as np
import pytest

from mori.core import ucx
from mori.core.batch import Batch

WINDOW_SLOTS = 1024
WINDOW_BYTES = 64 + WINDOW_SLOTS * 64  # header, then (word, id, addr, size) per 64-byte slot
PINS_AT, NOTES_AT = 64, 64 + WINDOW_SLOTS * 4  # the pin file: revoked line, counts, notes (head, tail)
NOTES = 1024
PIN_FILE_BYTES = NOTES_AT + 128 + NOTES * 16


def _pair(**options: object) -> tuple[ucx.UcxEngine, ucx.UcxEngine]:
    return ucx.make_engine("target", timeout=3.0), ucx.make_engine("initiator", timeout=3.0, **options)


def _raw_client(
    target: ucx.UcxEngine, ticket: int | None = None
) -> tuple[socket.socket, mmap.mmap, mmap.mmap, list[int]]:
    """A proven connection made by hand (as engine "raw" unless given a ticket): its socket, the
    window (read-only) and its pins."""
    nonce = os.urandom(16)
    probe = ctypes.create_string_buffer(nonce, 16)
    s = sh.client(target)
    ring = sh.ring_fd()
    ticket = target.admit("raw") if ticket is None else ticket
    socket.send_fds(s, [sh.hello(ticket, ctypes.addressof(probe), nonce)], [ring])
    os.close(ring)
    msg, fds, _, _ = socket.recv_fds(s, 64, 4)
    assert struct.unpack("<IB3xi", msg) == (sh.MAGIC, sh.HELLO_REPLY, 0) and len(fds) == 2
    window = mmap.mmap(fds[0], WINDOW_BYTES, prot=mmap.PROT_READ)
    pins = mmap.mmap(fds[1], PIN_FILE_BYTES)
    return s, window, pins, fds


def _close(s: socket.socket, window: mmap.mmap, pins: mmap.mmap, fds: list[int]) -> None:
    s.close()
    window.close()
    pins.close()
    for fd in fds:
        os.close(fd)


def _slot_of(window: mmap.mmap, mem_id: int) -> int:
    for i in range(WINDOW_SLOTS):
        word, rid = struct.unpack_from("<QQ", window, 64 + 64 * i)
        if word & 1 and rid == mem_id:
            return i
    raise AssertionError(f"memory id {mem_id} is not in the window")


def test_small_transfers_are_copied_by_the_initiator_and_noted_before_success() -> None:
    target, init = _pair()
    dst = np.zeros(1 << 20, np.uint8)
    src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        assert peer.same_host and peer.same_host_path == "direct"
        base = int(src.ctypes.data)
        for uid, (lo, ro, size) in enumerate([(0, 4096, 4096), (8192, 1000, 65536), (5, 77, 3)]):
            t = peer.submit(ucx.WRITE, 1, Batch.one(base + lo, ro, size), 1, uid=uid, notify=True)
            assert t.code() == 0, t.message()  # finished as it started: no thread of the target involved
            assert target.pop_inbound("initiator", uid) == 0  # noted before the initiator saw success
            assert np.array_equal(dst[ro : ro + size], src[lo : lo + size])
        dst[: 1 << 16] = 9
        t = peer.submit(ucx.READ, 1, Batch([0, 4096], [100, 60000], [512, 4096], base), 1)
        assert t.code() == 0 and (src[:512] == 9).all() and (src[4096:8192] == 9).all()
        # What the window cannot check goes to the target's thread, which refuses it as always.
        t = peer.submit(ucx.WRITE, 1, Batch.one(base, (1 << 20) - 100, 4096), 1, uid=50, notify=True)
        assert t.wait(5) and t.code() == 11 and "out of range" in t.message(), t.message()
        assert target.pop_inbound("initiator", 50) == 11
        t = peer.submit(ucx.WRITE, 1, Batch.one(base, 0, 4096), 7)
        assert t.wait(5) and t.code() == 12 and "not registered" in t.message(), t.message()
        assert target.stats()["refused"] == 2
    finally:
        init.close()
        target.close()


def test_a_lane_starts_one_pair_s_blocks_and_returns_refusals_as_failed_transfers() -> None:
    target, init = _pair()
    dst = np.zeros(1 << 16, np.uint8)
    src = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
    target.register_memory(3, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(4, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        lane = peer.lane(4, 3, True, False, "lane of 4 and 3: ")
        base = int(src.ctypes.data)
        # A direct copy finished as it started: every one returns the one FINISHED object.
        assert lane.start(ucx.WRITE, base + 10, 4096, 4096, 60) is ucx.FINISHED
        assert peer.submit(ucx.WRITE, 4, Batch.one(base, 0, 100), 3) is ucx.FINISHED
        assert ucx.FINISHED.code() == 0 and ucx.FINISHED.message() == ""
        assert target.pop_inbound("initiator", 60) == 0
        assert np.array_equal(dst[4096:8192], src[10:4106]) and np.array_equal(dst[:100], src[:100])
        dst[:4096] = 5
        assert lane.start(ucx.READ, base + 8192, 0, 4096, 61) is ucx.FINISHED
        assert (src[8192 : 8192 + 4096] == 5).all()
        # A block outside the local region is refused in the call: a failed transfer, worded as asked.
        t = lane.start(ucx.WRITE, base + (1 << 16) - 10, 0, 4096, 62)
        assert t is not ucx.FINISHED and t.code() == 11, t.message()
        assert t.message().startswith("lane of 4 and 3: row 0: local address"), t.message()
        # One past the target's region goes to its thread, which refuses it.
        t = lane.start(ucx.WRITE, base, (1 << 16) - 100, 4096, 63)
        assert t.wait(5) and t.code() == 11 and "out of range" in t.message(), t.message()
        assert np.array_equal(dst[4096:8192], src[10:4106])  # nothing else moved
        peer.close()
        assert lane.start(ucx.WRITE, base, 0, 4096, 64) is None  # nothing started
    finally:
        init.close()
        target.close()


def test_a_lane_s_start_refuses_arguments_that_are_not_five_ints_and_moves_nothing() -> None:
    target, init = _pair()
    dst = np.zeros(1 << 16, np.uint8)
    src = np.full(1 << 16, 7, np.uint8)
    target.register_memory(3, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(4, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        start = peer.lane(4, 3, True, False, "lane: ").start
        base = int(src.ctypes.data)
        with pytest.raises(TypeError, match="takes 5 arguments"):
            start(ucx.WRITE, base, 0, 4096)
        with pytest.raises(TypeError, match="takes 5 arguments"):
            start(ucx.WRITE, base, 0, 4096, 1, 2)
        with pytest.raises(TypeError, match="bytes must be an int, got float"):
            start(ucx.WRITE, base, 0, 4096.0, 1)
        with pytest.raises(TypeError, match="op must be an int, got str"):
            start("2", base, 0, 4096, 1)
        with pytest.raises(TypeError, match="keyword"):
            start(op=ucx.WRITE, src=base, dst=0, bytes=4096, uid=1)
        with pytest.raises(OverflowError):
            start(ucx.WRITE, base, -1, 4096, 1)
        with pytest.raises(OverflowError):
            start(ucx.WRITE, base, 0, 4096, 1 << 64)
        with pytest.raises(OverflowError, match="op is out of range"):
            start((1 << 32) + 2, base, 0, 4096, 1)
        assert not dst.any()  # nothing moved
        assert target.pop_inbound("initiator", 1) is None  # and nothing was noted
        # An op that is an int but neither read nor write is refused as a failed transfer.
        t = start(3, base, 0, 4096, 2)
        assert t is not ucx.FINISHED and t.code() == 11 and t.message().startswith("lane: "), t.message()
        assert not dst.any()
        # The function holds its lane (the lane object is gone); integers of other types are taken.
        assert start(ucx.WRITE, np.uint64(base), np.int64(0), np.int32(4096), 5) is ucx.FINISHED
        assert (dst[:4096] == 7).all() and not dst[4096:].any()
        peer.close()
    finally:
        init.close()
        target.close()


def test_direct_copies_off_leave_every_transfer_to_the_target_s_thread() -> None:
    target, init = _pair(same_host_direct=False)
    dst, src = np.zeros(4096, np.uint8), np.full(4096, 3, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        assert peer.same_host_path == "served: off in this engine (same_host_direct=False)"
        t = peer.submit(ucx.WRITE, 1, Batch.one(int(src.ctypes.data), 0, 4096), 1)
        assert t.wait(5) and t.code() == 0 and (dst == 3).all()
    finally:
        init.close()
        target.close()


def test_the_window_is_read_only_and_deregistration_waits_for_a_pin() -> None:
    """An initiator may only read the window; a pin it holds on a region keeps the region's
    deregistration waiting, which ends once the pin drops; the region is out of the window from
    the start of the deregistration, and a copy after it is refused by the target's thread."""
    target, init = _pair()
    dst, src = np.zeros(1 << 16, np.uint8), np.ones(1 << 16, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    s, window, pins, fds = _raw_client(target)
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], WINDOW_BYTES)  # sealed against writable mappings
        i = _slot_of(window, 1)
        assert struct.unpack_from("<QQ", window, 64 + 64 * i + 16) == (int(dst.ctypes.data), dst.nbytes)
        struct.pack_into("<I", pins, PINS_AT + 4 * i, 1)  # a copy in flight
        done: list[bool] = []
        waiter = threading.Thread(target=lambda: done.append(target.deregister_memory(1)))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not done  # held by the pin
        assert struct.unpack_from("<Q", window, 64 + 64 * i)[0] & 1 == 0  # withdrawn already
        struct.pack_into("<I", pins, PINS_AT + 4 * i, 0)
        waiter.join(10)
        assert done == [True]
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        t = peer.submit(ucx.WRITE, 1, Batch.one(int(src.ctypes.data), 0, 4096), 1)
        assert t.wait(5) and t.code() == 12, t.message()
        assert (dst == 0).all()
    finally:
        _close(s, window, pins, fds)
        init.close()
        target.close()


def _pin_and_wait(target: ucx.UcxEngine, ticket: int, ready: Any) -> None:
    """A forked initiator: connects by hand, pins region 1 as a copy in flight would, and waits."""
    _s, window, pins, _fds = _raw_client(target, ticket)
    struct.pack_into("<I", pins, PINS_AT + 4 * _slot_of(window, 1), 1)
    ready.set()
    time.sleep(600)


def test_the_pins_of_a_killed_initiator_hold_nothing() -> None:
    """A process that dies holding a pin copies no more: deregistration does not wait for it (its
    pidfd says it is gone; waiting would end in "transfers still use it" after the timeout)."""
    target = ucx.make_engine("target", timeout=3.0)
    dst = np.zeros(1 << 16, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    ctx = mp.get_context("fork")  # the child only speaks to the socket and maps memory
    ready = ctx.Event()
    child = ctx.Process(target=_pin_and_wait, args=(target, target.admit("child"), ready))
    child.start()
    try:
        assert ready.wait(30)
        child.kill()
        child.join()
        assert target.deregister_memory(1) is True
    finally:
        if child.is_alive():
            child.kill()
        target.close()


def test_notes_written_wrong_are_counted_and_record_nothing() -> None:
    target = ucx.make_engine("target", timeout=3.0)
    s, window, pins, fds = _raw_client(target)
    try:
        before = target.stats()["malformed"]
        struct.pack_into("<QQ", pins, NOTES_AT + 128, 77, 11)  # a note of a failure: never written
        struct.pack_into("<Q", pins, NOTES_AT, 1)
        assert target.inbound_count() == 0 and target.pop_inbound("raw", 77) is None
        struct.pack_into("<Q", pins, NOTES_AT, 1 + NOTES + 5)  # more notes than the ring holds
        assert target.inbound_count() == 0
        assert target.stats()["malformed"] == before + 2
        struct.pack_into("<QQ", pins, NOTES_AT + 128 + 16 * ((1 + NOTES + 5) % NOTES), 78, 0)
        struct.pack_into("<Q", pins, NOTES_AT, 1 + NOTES + 6)  # a well-formed one after them
        assert target.pop_inbound("raw", 78) == 0
    finally:
        _close(s, window, pins, fds)
        target.close()
