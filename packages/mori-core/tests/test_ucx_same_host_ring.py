"""The same-host path's request ring (csrc/same_host/ring.hpp): a full ring holds its poster until the
target makes room, and fails it at the deadline when none comes, moving nothing after; a target
killed with requests in the ring fails them at once; a request whose slot changes while the
target serves it cannot reach outside a registration."""

from __future__ import annotations

import ctypes
import signal
import threading

import _same_host_client as sh
import numpy as np
from _ucx_procs import SIZE, engine_pair, fill

from mori.core import ucx

BLOCK = SIZE // (sh.SLOTS + 8)  # one block per transfer: more transfers than the ring has slots


def _start(pair, i: int) -> int:  # noqa: ANN001 (a _ucx_procs.Pair)
    return pair.init.call("start", "target", ucx.WRITE, [i * BLOCK], [i * BLOCK], [BLOCK])


def test_a_full_ring_holds_the_poster_until_there_is_room_and_loses_nothing() -> None:
    with engine_pair("wheel", "same-host", timeout=30.0) as pair:
        fill(pair.init.arr, 5)
        fill(pair.target.arr, 6)
        assert pair.transfer(ucx.WRITE, [0], [0], [4096])[0] == "SUCCESS"  # connected
        pair.target.stop()
        started = [_start(pair, i) for i in range(sh.SLOTS)]  # the ring is full now
        resumed = threading.Event()

        def resume() -> None:
            resumed.set()  # before the signal: a poster that got room sees it set
            pair.target.signal(signal.SIGCONT)

        timer = threading.Timer(0.5, resume)
        timer.start()
        try:
            started.append(_start(pair, sh.SLOTS))  # waits for a slot: the stopped target frees none
            assert resumed.is_set()
            started += [_start(pair, i) for i in range(sh.SLOTS + 1, sh.SLOTS + 8)]
        finally:
            timer.join()
        for tid in started:
            code, msg, _ = pair.init.call("finish", tid)
            assert code == "SUCCESS", msg
        n = (sh.SLOTS + 8) * BLOCK
        assert np.array_equal(pair.target.region[:n], pair.init.region[:n])


def test_a_ring_that_stays_full_fails_the_poster_at_the_deadline_and_nothing_lands_after() -> None:
    with engine_pair("wheel", "same-host", timeout=3.0) as pair:
        fill(pair.init.arr, 7)
        fill(pair.target.arr, 8)
        assert pair.transfer(ucx.WRITE, [0], [0], [4096])[0] == "SUCCESS"
        pair.target.stop()
        try:
            started = [_start(pair, i) for i in range(sh.SLOTS + 1)]
            codes = [pair.init.call("finish", tid) for tid in started]
            before = pair.target.arr.copy()
        finally:
            pair.target.signal(signal.SIGCONT)
        # The poster waiting for room fails at its deadline, or just before it when the earlier
        # transfers' deadlines (a few ms earlier) fail the link first.
        code, msg, _ = codes[-1]
        assert code == "ERR_TRANSPORT" and (
            "left its same-host request ring full for 3 s (timeout)" in msg
            or "no completion from engine 'target' within 3 s" in msg
        ), msg
        for code, msg, _ in codes[:-1]:
            assert code == "ERR_TRANSPORT" and "'target'" in msg, msg
        assert not pair.init.call("healthy", "target")
        # The target runs again: the requests it never claimed were taken back; none lands.
        assert pair.target.call("stats")["refused"] == 0
        assert np.array_equal(pair.target.arr, before)


def test_a_target_killed_with_requests_in_the_ring_fails_them_at_once() -> None:
    with engine_pair("wheel", "same-host", timeout=600.0) as pair:
        assert pair.transfer(ucx.WRITE, [0], [0], [4096])[0] == "SUCCESS"
        pair.target.stop()
        started = [_start(pair, i) for i in range(8)]
        pair.target.signal(signal.SIGKILL)
        for tid in started:  # long before the 600 s deadline: the socket closed with the process
            code, msg, _ = pair.init.call("finish", tid, 60.0)
            assert code == "ERR_TRANSPORT" and "closed its same-host socket" in msg, (code, msg)


def test_a_slot_rewritten_while_it_is_served_stays_inside_the_registration() -> None:
    """The target copies a request out of the ring before it checks it: an initiator rewriting
    the slot meanwhile changes nothing of what moves."""
    target = ucx.make_engine("target", timeout=3.0)
    arena = np.full(3 << 16, 0x5A, np.uint8)  # [guard | registered | guard]
    target.register_memory(1, int(arena.ctypes.data) + (1 << 16), 1 << 16)
    mine = np.full(1 << 16, 0x11, np.uint8)
    try:
        nonce = bytes(range(16))
        probe = ctypes.create_string_buffer(nonce, 16)
        ring = sh.Ring(target, target.admit("initiator"), ctypes.addressof(probe), nonce)
        assert ring.verdict == (sh.MAGIC, sh.HELLO_REPLY, 0)
        stop = threading.Event()
        forged = (1 << 16) - 16  # 16 bytes before the end: a 4 KiB block here runs out of the region

        def rewrite() -> None:  # flips every slot's first entry between a valid and a forged offset
            valid, bad = (0).to_bytes(8, "little"), forged.to_bytes(8, "little")
            while not stop.is_set():
                for i in range(sh.SLOTS):
                    off = ring.slot(i) + 80 + 8
                    ring.mem[off : off + 8] = bad
                    ring.mem[off : off + 8] = valid

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            for rid in range(500):
                seq = ring.post(2, rid, [(1, 0, 4096, int(mine.ctypes.data))])
                assert ring.reply(seq)[2] in (0, 11)
        finally:
            stop.set()
            writer.join()
        ring.close()
        assert (arena[: 1 << 16] == 0x5A).all() and (arena[2 << 16 :] == 0x5A).all()
        region = arena[1 << 16 : 2 << 16]
        assert (region[4096:forged] == 0x5A).all()  # only ever the checked block
    finally:
        target.close()
