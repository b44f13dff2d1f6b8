"""Frames on the bootstrap's TCP streams, deadlines, and the blocking helpers rendezvous uses.

Every message is a 16-byte header followed by its payload::

    kind (u8)  op (u8)  reserved (u16)  seq (u32)  length (u64)

``kind`` says what the payload is (hello, rank table, error, collective data); for data frames
``op`` and ``seq`` name the collective and its number, so a rank that called a different
collective than its peers is caught instead of misreading their bytes.
"""

from __future__ import annotations

import enum
import selectors
import socket
import struct
import time
from typing import Any

import msgpack

from ._errors import BootstrapError, BootstrapTimeout

__all__ = [
    "HELLO_MAX_PAYLOAD",
    "MAX_PENDING_HELLOS",
    "HEADER",
    "Kind",
    "Op",
    "Deadline",
    "Frame",
    "FrameReader",
    "pack_header",
    "send_frame",
    "recv_frame",
    "encode",
    "decode",
    "raise_peer_error",
]

HEADER = struct.Struct("!BBHIQ")
# A length this large can only be a stream that lost its place (or a stranger's bytes).
_MAX_PAYLOAD = 1 << 40
#: Largest hello a listener reads from a connection that has not introduced itself yet.
HELLO_MAX_PAYLOAD = 64 << 10
#: Connections a listener keeps while their hello arrives; a newer one drops the oldest.
MAX_PENDING_HELLOS = 64


class Kind(enum.IntEnum):
    """What a frame carries."""

    HELLO = 1  # a rank introducing itself on a new connection (msgpack)
    TABLE = 2  # rank 0's table of every rank's listening address (msgpack)
    ERROR = 3  # a peer's reason for giving up (msgpack)
    DATA = 4  # one collective's payload from the sender (raw bytes)


class Op(enum.IntEnum):
    """The collective a data frame belongs to."""

    NONE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    BARRIER = 4


class Deadline:
    """A point in time on the monotonic clock, ``seconds`` from now."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, never below 0."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.at


class Frame:
    """One received frame: its header fields and payload."""

    __slots__ = ("kind", "op", "seq", "payload")

    def __init__(self, kind: int, op: int, seq: int, payload: bytes | bytearray) -> None:
        self.kind, self.op, self.seq, self.payload = kind, op, seq, payload

    def message(self) -> Any:
        """The decoded msgpack payload (hello, table, error)."""
        return decode(self.payload)


def pack_header(kind: Kind, length: int, op: Op = Op.NONE, seq: int = 0) -> bytes:
    """The 16-byte header of a frame."""
    return HEADER.pack(kind, op, 0, seq & 0xFFFFFFFF, length)


def encode(obj: Any) -> bytes:
    """msgpack encoding of a control message."""
    return msgpack.packb(obj, use_bin_type=True)


def decode(data: bytes | bytearray) -> Any:
    """Decodes a control message, turning garbage into a :class:`BootstrapError`."""
    try:
        return msgpack.unpackb(bytes(data), raw=False)
    except Exception as exc:
        raise BootstrapError(f"garbled bootstrap control message ({exc})") from None


class FrameReader:
    """Reads one frame from a non-blocking socket in as many steps as the data arrives.

    It never reads past the end of its frame: the next frame on the stream stays in the kernel
    for whoever reads next. A payload that is already wholly in the socket comes out as one
    ``bytes`` object, which the collectives hand to the caller without another copy.
    """

    def __init__(self, max_payload: int = _MAX_PAYLOAD) -> None:
        self._max_payload = max_payload
        self._header = bytearray(HEADER.size)
        self._filled = 0
        self._length: int | None = None
        self._payload: bytearray | None = None
        self._kind = self._op = self._seq = 0

    def feed(self, sock: socket.socket) -> Frame | None:
        """Reads what is available; returns the frame once complete. EOF raises ``EOFError``."""
        while True:
            if self._length is None:
                n = self._recv_into(sock, memoryview(self._header)[self._filled :])
                if n is None:
                    return None
                self._filled += n
                if self._filled < HEADER.size:
                    continue
                self._kind, self._op, _, self._seq, length = HEADER.unpack(self._header)
                if length > self._max_payload or self._kind not in Kind.__members__.values():
                    raise BootstrapError(f"stream out of step: header kind={self._kind} length={length}")
                self._length, self._filled = length, 0
                if length == 0:
                    return self._finish(b"")
            elif self._payload is None:
                try:
                    # At most 1 MiB up front: recv allocates what it is asked for before data comes.
                    chunk = sock.recv(min(self._length, 1 << 20))
                except (BlockingIOError, InterruptedError):
                    return None
                if not chunk:
                    raise EOFError
                if len(chunk) == self._length:
                    return self._finish(chunk)
                self._payload = bytearray(self._length)
                self._payload[: len(chunk)] = chunk
                self._filled = len(chunk)
            else:
                n = self._recv_into(sock, memoryview(self._payload)[self._filled :])
                if n is None:
                    return None
                self._filled += n
                if self._filled == self._length:
                    return self._finish(self._payload)

    def _finish(self, payload: bytes | bytearray) -> Frame:
        frame = Frame(self._kind, self._op, self._seq, payload)
        self._length, self._payload, self._filled = None, None, 0
        return frame

    @staticmethod
    def _recv_into(sock: socket.socket, into: memoryview) -> int | None:
        try:
            n = sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            return None
        if n == 0:
            raise EOFError
        return n


def send_frame(sock: socket.socket, kind: Kind, payload: bytes, deadline: Deadline) -> None:
    """Sends a whole frame on a socket before ``deadline`` (small control frames only)."""
    sock.settimeout(max(deadline.remaining(), 0.001))
    try:
        sock.sendall(pack_header(kind, len(payload)) + payload)
    finally:
        sock.setblocking(False)


def recv_frame(sock: socket.socket, deadline: Deadline) -> Frame | None:
    """Receives one whole frame, or ``None`` when ``deadline`` passes first. EOF raises ``EOFError``."""
    reader = FrameReader()
    sock.setblocking(False)
    with selectors.DefaultSelector() as sel:
        sel.register(sock, selectors.EVENT_READ)
        while True:
            frame = reader.feed(sock)
            if frame is not None:
                return frame
            if not sel.select(deadline.remaining()) and deadline.expired():
                return None


def raise_peer_error(frame: Frame, who: str) -> None:
    """Turns an ERROR frame from ``who`` into the matching exception."""
    msg = frame.message()
    text = f"{who}: {msg.get('message', '?')}" if isinstance(msg, dict) else f"{who} sent an error"
    if isinstance(msg, dict) and msg.get("timeout"):
        raise BootstrapTimeout(text)
    raise BootstrapError(text)
