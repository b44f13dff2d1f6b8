"""The UCX engine's same-host path (process_vm_readv/writev, each request checked by the target):
who may use it, what it refuses, and the fall back to UCX where the kernel does not allow it.
The data path itself runs in test_ucx_engine.py and test_ucx_failures.py ("same-host" cases).

Hostile clients here speak to the target's socket and ring directly, as a process on the host could
(_same_host_client); the ring's own tests are in test_ucx_same_host_ring.py."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import time

import _same_host_client as sh
import numpy as np
import pytest
from _ucx_procs import EngineProcess, engine_pair, fill

from mori.core import ucx
from mori.core.batch import Batch
from mori.core.ucx import READ, WRITE


def _engines() -> tuple[ucx.UcxEngine, ucx.UcxEngine]:
    return ucx.make_engine("target", timeout=3.0), ucx.make_engine("initiator", timeout=3.0)


def test_only_this_host_and_pid_namespace_are_offered() -> None:
    target, init = _engines()
    try:
        assert target.same_host_address.startswith(b"mori-same-host/1 ")
        assert ucx.make_engine("off", same_host=False).same_host_address == b""
        ticket = target.admit("initiator")
        tag, host, pidns, name = target.same_host_address.split(b" ")
        for other in (
            b" ".join([tag, b"another-machine/1", pidns, name]),
            b" ".join([tag, host, b"1", name]),
            b"garbage",
            b"mori-same-host/2 " + host + b" " + pidns + b" " + name,
        ):
            peer = init.connect("target", target.addresses, ticket, other)
            assert not peer.same_host and peer.same_host_refusal == "", other  # not offered: UCX, silently
            peer.close()
        peer = init.connect("target", target.addresses, ticket, target.same_host_address)
        assert peer.same_host and peer.same_host_refusal == ""
    finally:
        init.close()
        target.close()


def test_hostile_clients_are_dropped_and_move_nothing() -> None:
    """Garbage, a bell before hello, a ticket the target never issued, a probe naming another
    process's memory, and rings the target must not map (none, unsealed, the wrong size): each
    connection is closed and no byte of the target changes."""
    target, init = _engines()
    buf = np.zeros(1 << 16, np.uint8)
    buf[:] = 0x5A
    target.register_memory(1, int(buf.ctypes.data), buf.nbytes)
    mine = np.arange(4096, dtype=np.uint8)
    try:
        ticket = target.admit("initiator")
        before = target.stats()
        nonce = bytes(range(16))
        probe = ctypes.create_string_buffer(nonce, 16)
        good = sh.hello(ticket, ctypes.addressof(probe), nonce)
        cases = [
            (b"\x00" * 40, None),  # no magic
            (struct.pack("<IB3x", sh.MAGIC, sh.BELL), None),  # no hello first
            (sh.hello(ticket ^ 1, ctypes.addressof(probe), nonce), sh.ring_fd()),  # ticket never issued
            (sh.hello(ticket, ctypes.addressof(probe), b"\xff" * 16), sh.ring_fd()),  # probe does not match
            (struct.pack("<IB", sh.MAGIC, sh.HELLO) + b"\x00" * 100, sh.ring_fd()),  # wrong size
            (good, None),  # no ring
            (good, sh.ring_fd(seals=0)),  # a ring that could shrink
            (good, sh.ring_fd(size=sh.RING_BYTES - 4096)),  # the wrong size
        ]
        for msg, fd in cases:
            s = sh.client(target)
            if fd is None:
                s.send(msg)
            else:
                socket.send_fds(s, [msg], [fd])
                os.close(fd)
            reply = s.recv(64)
            if reply:  # the probe's verdict, then the connection closes
                magic, kind, err = struct.unpack("<IB3xi", reply)
                assert (magic, kind) == (sh.MAGIC, sh.HELLO_REPLY) and err != 0
                assert s.recv(64) == b""
            s.close()
        assert (buf == 0x5A).all()
        after = target.stats()
        assert after["malformed"] >= before["malformed"] + 6 and after["bad_tickets"] == before["bad_tickets"] + 1
        # A proven client still cannot reach outside a live registration.
        ring = sh.Ring(target, ticket, ctypes.addressof(probe), nonce)
        assert ring.verdict == (sh.MAGIC, sh.HELLO_REPLY, 0)
        for rid, entry, code in (
            (1, (1, 1 << 16, 1, 0), 11),
            (2, (1, (1 << 16) - 4095, 4096, 0), 11),
            (3, (2, 0, 1, 0), 12),
            (4, (1, 2**64 - 1, 2, 0), 11),
        ):
            seq = ring.post(
                2, rid, [(1, 0, 16, int(mine.ctypes.data)), (entry[0], entry[1], entry[2], int(mine.ctypes.data))]
            )
            magic, kind, got, reason, which, err, echoed = ring.reply(seq)
            assert (magic, kind, got, which, echoed) == (sh.MAGIC, sh.REPLY, code, 1, rid), (rid, got, which)
        assert (buf == 0x5A).all()  # the valid first block of each refused request did not move either
        ring.post(9, 5, [(1, 0, 16, 0)])  # an op that does not exist: dropped
        assert ring.closed()
        ring.close()
        ring = sh.Ring(target, ticket, ctypes.addressof(probe), nonce)
        ring.post(2, 6, [(1, 0, 16, int(mine.ctypes.data))], count=sh.MAX_ENTRIES + 1)  # more than a slot holds
        assert ring.closed()
        ring.close()
        assert (buf == 0x5A).all()
    finally:
        init.close()
        target.close()


def test_deregistration_waits_and_then_refuses() -> None:
    target, init = _engines()
    src, dst = np.ones(8 << 20, np.uint8), np.zeros(8 << 20, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        assert peer.same_host
        transfers = [peer.submit(ucx.WRITE, 1, Batch.one(int(src.ctypes.data), 0, src.nbytes), 1) for _ in range(4)]
        assert target.deregister_memory(1)
        for t in transfers:  # finished, each all or refused
            assert t.wait(5) and t.code() in (0, 12), t.message()
        dst[:] = 7
        t = peer.submit(ucx.WRITE, 1, Batch.one(int(src.ctypes.data), 0, 4096), 1)
        assert t.wait(5) and t.code() == 12 and "not registered" in t.message()
        assert (dst == 7).all()
    finally:
        init.close()
        target.close()


def test_notification_of_a_transfer_of_several_requests() -> None:
    """A transfer cut into several requests (1024 blocks each) is recorded once at the target,
    after its last request: success, or the first refusal among its requests."""
    target, init = _engines()
    src, dst = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20], np.zeros(1 << 20, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        n = 3000  # three requests; blocks of 64 bytes, every other one, so that none merge
        offs = [2 * 64 * i for i in range(n)]
        t = peer.submit(ucx.WRITE, 1, Batch(offs, offs, [64] * n, int(src.ctypes.data)), 1, uid=7, notify=True)
        assert t.wait(5) and t.code() == 0, t.message()
        bad = offs.copy()
        bad[1500] = 1 << 20  # in the second request
        t = peer.submit(ucx.WRITE, 1, Batch(offs, bad, [64] * n, int(src.ctypes.data)), 1, uid=8, notify=True)
        assert t.wait(5) and t.code() == 11, t.message()
        deadline = time.monotonic() + 5
        while target.inbound_count() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert target.pop_inbound("initiator", 7) == 0
        assert target.pop_inbound("initiator", 8) == 11
        assert target.inbound_count() == 0
        assert all(np.array_equal(dst[o : o + 64], src[o : o + 64]) for o in offs[::97])
    finally:
        init.close()
        target.close()


def test_refused_by_the_kernel_falls_back_to_ucx_and_says_so_once() -> None:
    """A target running as another user may not read this process's memory (EPERM): the peer
    stays on UCX, logs why once, and moves every byte there."""
    target = EngineProcess("target", "wheel", None, {"TLS": "tcp"}, run_as=65534)
    init = EngineProcess("initiator", "wheel", None, {"TLS": "tcp"})
    try:
        for key in ("target", "target-again"):
            ticket = target.call("admit", "initiator")
            same_host, refusal = init.call("connect", key, target.addresses, ticket, target.same_host)
            assert not same_host
            assert "process_vm_readv" in refusal and "errno 1" in refusal, refusal
        warnings = init.call("warnings")
        assert len([w for w in warnings if "same-host" in w]) == 1, warnings
        fill(init.arr, 4)
        code, msg, _ = init.call("transfer", "target", ucx.WRITE, [0, 8192], [4096, 1 << 20], [4096, 1 << 20])
        assert code == "SUCCESS", msg
        assert np.array_equal(target.region[4096:8192], init.region[:4096])
        assert np.array_equal(target.region[1 << 20 : 2 << 20], init.region[8192 : 8192 + (1 << 20)])
    finally:
        init.remove()
        target.remove()


def test_peer_closed_mid_transfer_fails_it() -> None:
    target, init = _engines()
    src = np.ones(64 << 20, np.uint8)
    dst = np.zeros(64 << 20, np.uint8)
    target.register_memory(1, int(dst.ctypes.data), dst.nbytes)
    init.register_memory(1, int(src.ctypes.data), src.nbytes)
    try:
        peer = init.connect("target", target.addresses, target.admit("initiator"), target.same_host_address)
        rows = Batch([i << 20 for i in range(64)], [i << 20 for i in range(64)], [1 << 20] * 64, int(src.ctypes.data))
        transfers = [peer.submit(ucx.WRITE, 1, rows, 1) for _ in range(8)]
        peer.close()
        time.sleep(0.01)
        for t in transfers:
            assert t.wait(5)
            assert t.code() in (0, 13), t.message()  # done before the close, or failed by it
        assert not peer.healthy()
    finally:
        init.close()
        target.close()


@pytest.mark.parametrize("polling", [True, False], ids=["polling", "event"])
def test_a_transfer_no_one_waits_for_ends_on_its_own(polling: bool) -> None:
    """A caller that never waits (it only reads the code, as a status's Code() does) still sees
    its transfers end: the target rings the initiator's socket for every completion no caller of
    it reaped (while its thread polls, 20 µs later unless one reaped it meanwhile; before that
    thread sleeps, at once), with progress threads that poll and with ones that only sleep. Every
    byte checked."""
    with engine_pair("wheel", "same-host", polling=polling) as pair:
        fill(pair.init.arr, 21)
        fill(pair.target.arr, 22)
        for op, size in ((WRITE, 4096), (READ, 4096), (WRITE, 1 << 20), (READ, 1 << 20)):
            for _ in range(20):
                tid = pair.init.call("start", "target", op, [0], [size], [size])
                code, secs = pair.init.call("poll", tid, 10.0)
                assert code == "SUCCESS" and secs < 10
            # Either way the initiator's first `size` bytes and the target's next `size` are one copy.
            assert np.array_equal(pair.init.region[:size], pair.target.region[size : 2 * size])
