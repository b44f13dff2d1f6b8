"""A client of the UCX engine's same-host socket and request ring written from the wire layout
(csrc/same_host/ring.hpp), as any process on the host could speak it: for the hostile tests."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import time

from mori.core import ucx

MAGIC = 0x4D534830
HELLO, HELLO_REPLY, REQUEST, REPLY, NOTE, BELL = 1, 2, 3, 4, 5, 6
SLOTS, MAX_ENTRIES = 32, 1024
HEADER, SLOT = 128, 80 + MAX_ENTRIES * 32  # RingHeader, Slot (state, reply at 8, request at 48, entries at 80)
RING_BYTES = HEADER + SLOTS * SLOT
FREE, POSTED, DONE = 0, 1, 2


def socket_of(engine: ucx.UcxEngine) -> bytes:
    tag, _host, _pidns, name = engine.same_host_address.split(b" ")
    assert tag == b"mori-same-host/1"
    return b"\0" + name


def client(engine: ucx.UcxEngine) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(socket_of(engine))
    return s


def hello(ticket: int, probe: int, nonce: bytes) -> bytes:
    return struct.pack("<IB3xQQ16s", MAGIC, HELLO, ticket, probe, nonce)


def ring_fd(size: int = RING_BYTES, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) -> int:
    """A memfd for a ring: the right size and seals unless told otherwise."""
    fd = os.memfd_create("test-ring", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


class Ring:
    """A proven connection: hello with a ring, the target's verdict read."""

    def __init__(self, engine: ucx.UcxEngine, ticket: int, probe: int, nonce: bytes) -> None:
        self.sock = client(engine)
        fd = ring_fd()
        self.mem = mmap.mmap(fd, RING_BYTES)
        socket.send_fds(self.sock, [hello(ticket, probe, nonce)], [fd])
        os.close(fd)
        self.verdict = struct.unpack("<IB3xi", self.sock.recv(64))
        self.seq = 0

    def slot(self, seq: int) -> int:
        return HEADER + (seq % SLOTS) * SLOT

    def post(self, op: int, rid: int, entries: list[tuple[int, int, int, int]], count: int | None = None) -> int:
        """Writes a request into the next slot, marks it posted and rings; its sequence."""
        seq, off = self.seq, self.slot(self.seq)
        self.seq += 1
        body = b"".join(struct.pack("<QQQQ", *e) for e in entries)
        self.mem[off + 48 : off + 76] = struct.pack(
            "<IBBHIQQ", MAGIC, REQUEST, op, len(entries) if count is None else count, 0, rid, 0
        )
        self.mem[off + 80 : off + 80 + len(body)] = body
        self.mem[off : off + 4] = struct.pack("<I", POSTED)
        # A polling target may have served (or dropped) it already: then the bell finds it gone.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.sock.send(struct.pack("<IB3x", MAGIC, BELL))
        return seq

    def reply(self, seq: int) -> tuple[int, int, int, int, int, int, int]:
        """(magic, type, code, reason, entry, errno, id) once the target marked slot seq done (5 s)."""
        off = self.slot(seq)
        deadline = time.monotonic() + 5
        while struct.unpack("<I", self.mem[off : off + 4])[0] != DONE:
            assert time.monotonic() < deadline, "the target did not serve the request within 5 s"
            time.sleep(0.0005)
        got = struct.unpack("<IB3xiIIi4xQ", self.mem[off + 8 : off + 44])
        self.mem[off : off + 4] = struct.pack("<I", FREE)
        # Its doorbells read: a target whose doorbells stay unread serves this ring no more.
        self.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while self.sock.recv(64):
                pass
        self.sock.settimeout(5)
        return got

    def closed(self) -> bool:
        """Whether the target closed the connection."""
        try:
            while True:
                if self.sock.recv(64) == b"":
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()
        self.mem.close()
