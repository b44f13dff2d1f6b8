"""Direct connections between ranks and the one-round exchange every collective is made of.

Each rank keeps one outgoing stream to every rank it has sent to and one incoming stream from
every rank that has sent to it; streams open on first use, so a job that only ever broadcasts
from rank 0 holds ``world - 1`` connections, not ``world**2``. A collective is a single round:
queue a frame for each destination, then drive all sends, receives and new connections with
non-blocking sockets until every expected frame is in. Large messages to many peers therefore
flow at once without deadlock, each frame crosses one hop, and when time runs out this rank
knows exactly which ranks it is still waiting for.
"""

from __future__ import annotations

import resource
import selectors
import socket
import time
from collections.abc import Collection, Mapping

from .. import log
from ._errors import BootstrapError, BootstrapTimeout
from ._rendezvous import RankInfo, connect, set_nodelay
from ._wire import (
    HELLO_MAX_PAYLOAD,
    MAX_PENDING_HELLOS,
    Deadline,
    FrameReader,
    Kind,
    Op,
    encode,
    pack_header,
    raise_peer_error,
    send_frame,
)

__all__ = ["Mesh"]

_log = log.get_logger("core.bootstrap")


class _Send:
    """One frame leaving on a non-blocking socket, header and payload gathered in one sendmsg."""

    def __init__(self, sock: socket.socket, header: bytes, payload: memoryview) -> None:
        self.sock = sock
        self.bufs = [memoryview(header), payload] if len(payload) else [memoryview(header)]

    def progress(self) -> bool:
        """Sends what the socket takes now; True once the whole frame is out."""
        while self.bufs:
            try:
                sent = self.sock.sendmsg(self.bufs)
            except (BlockingIOError, InterruptedError):
                return False
            while sent:
                head = self.bufs[0]
                if sent >= len(head):
                    sent -= len(head)
                    self.bufs.pop(0)
                else:
                    self.bufs[0] = head[sent:]
                    sent = 0
        return True


def _make_room_for_fds(world: int) -> None:
    """A full mesh needs two sockets per peer; lift the soft fd limit toward the hard one if short."""
    want = 2 * world + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


class Mesh:
    """This rank's listener and its streams to and from the other ranks."""

    def __init__(
        self,
        rank: int,
        world: int,
        nonce: bytes,
        listener: socket.socket,
        table: list[RankInfo],
        out: dict[int, socket.socket],
        inc: dict[int, socket.socket],
    ) -> None:
        _make_room_for_fds(world)
        self.rank, self.world, self.nonce, self.table = rank, world, nonce, table
        self._listener = listener
        self._listener.setblocking(False)
        self._out = out
        self._in = inc
        # Accepted connections whose hello has not fully arrived yet.
        self._pending: dict[socket.socket, FrameReader] = {}
        for sock in [*out.values(), *inc.values()]:
            sock.setblocking(False)

    def describe(self, rank: int) -> str:
        """Names a rank with its pid and host for error messages."""
        return self.table[rank].describe(rank)

    def close(self) -> None:
        """Closes every socket (peers waiting on this rank then see it leave instead of waiting)."""
        for sock in [*self._out.values(), *self._in.values(), *self._pending, self._listener]:
            sock.close()
        self._out.clear()
        self._in.clear()
        self._pending.clear()

    def _connect(self, peer: int, deadline: Deadline, what: str) -> socket.socket:
        info = self.table[peer]
        try:
            sock = connect(info.host, info.port, deadline, retry_refused=False)
            send_frame(sock, Kind.HELLO, encode({"nonce": self.nonce, "rank": self.rank}), deadline)
        except ConnectionRefusedError:
            raise BootstrapError(
                f"{what}: cannot reach {self.describe(peer)} at {info.host}:{info.port}: "
                "connection refused (the process has exited)"
            ) from None
        except TimeoutError:
            raise BootstrapTimeout(
                f"{what}: ranks [{peer}] did not accept a connection within {deadline.seconds:g} s"
            ) from None
        except OSError as exc:
            raise BootstrapError(f"{what}: cannot connect to {self.describe(peer)}: {exc}") from exc
        sock.setblocking(False)
        self._out[peer] = sock
        return sock

    def exchange(
        self, op: Op, seq: int, sends: Mapping[int, memoryview], recv_from: Collection[int], deadline: Deadline
    ) -> dict[int, bytes | bytearray]:
        """Sends ``sends[p]`` to each rank p and returns the frame of this collective from each of ``recv_from``."""
        what = f"{op.name.lower()} #{seq}"
        received: dict[int, bytes | bytearray] = {}
        waiting = set(recv_from)
        sel = selectors.DefaultSelector()
        try:
            sending: dict[int, _Send] = {}
            for peer, data in sends.items():
                sock = self._out.get(peer) or self._connect(peer, deadline, what)
                send = _Send(sock, pack_header(Kind.DATA, len(data), op, seq), data)
                # Try at once: small frames leave now, before this rank can fail on a receive.
                if not self._progress_send(send, peer, what):
                    sending[peer] = send
                    sel.register(sock, selectors.EVENT_WRITE, ("send", peer))
            readers: dict[int, FrameReader] = {}
            for peer in waiting:
                if peer in self._in:
                    readers[peer] = FrameReader()
                    sel.register(self._in[peer], selectors.EVENT_READ, ("recv", peer))
            if waiting - readers.keys():
                sel.register(self._listener, selectors.EVENT_READ, ("accept", None))
                for conn in self._pending:
                    sel.register(conn, selectors.EVENT_READ, ("hello", conn))
            while sending or waiting:
                events = sel.select(deadline.remaining())
                if not events and deadline.expired():
                    raise BootstrapTimeout(self._timeout_message(what, waiting, sending, deadline))
                for key, _ in events:
                    kind, arg = key.data
                    if kind == "send":
                        if self._progress_send(sending[arg], arg, what):
                            del sending[arg]
                            sel.unregister(key.fileobj)
                    elif kind == "recv":
                        payload = self._progress_recv(readers[arg], arg, op, seq, what)
                        if payload is not None:
                            received[arg] = payload
                            waiting.discard(arg)
                            sel.unregister(key.fileobj)
                    elif kind == "accept":
                        self._accept(sel)
                    else:
                        joined = self._progress_hello(arg, sel)
                        if joined is not None and joined in waiting:
                            readers[joined] = FrameReader()
                            sel.register(self._in[joined], selectors.EVENT_READ, ("recv", joined))
            return received
        finally:
            sel.close()

    def _timeout_message(self, what: str, waiting: set[int], sending: Mapping[int, _Send], deadline: Deadline) -> str:
        parts = []
        if waiting:
            parts.append(f"ranks {sorted(waiting)} did not arrive within {deadline.seconds:g} s")
        if sending:
            parts.append(f"ranks {sorted(sending)} did not take this rank's data within {deadline.seconds:g} s")
        return f"{what}: " + "; ".join(parts)

    def _progress_send(self, send: _Send, peer: int, what: str) -> bool:
        try:
            return send.progress()
        except OSError as exc:
            raise BootstrapError(
                f"{what}: {self.describe(peer)} went away while this rank sent to it "
                f"(the process exited or failed: {exc.strerror or exc})"
            ) from None

    def _progress_recv(self, reader: FrameReader, peer: int, op: Op, seq: int, what: str) -> bytes | bytearray | None:
        try:
            frame = reader.feed(self._in[peer])
        except (EOFError, ConnectionError):
            raise BootstrapError(
                f"{what}: {self.describe(peer)} closed its connection (the process exited or failed)"
            ) from None
        except BootstrapError as exc:
            raise BootstrapError(f"{what}: stream from {self.describe(peer)} is corrupt: {exc}") from None
        if frame is None:
            return None
        if frame.kind == Kind.ERROR:
            raise_peer_error(frame, f"{what}: {self.describe(peer)}")
        if frame.kind != Kind.DATA or frame.op != op or frame.seq != seq & 0xFFFFFFFF:
            theirs = Op(frame.op).name.lower() if frame.op in Op.__members__.values() else f"op {frame.op}"
            raise BootstrapError(
                f"{what}: {self.describe(peer)} sent {theirs} #{frame.seq} instead; every rank "
                "must call the same collectives in the same order"
            )
        return frame.payload

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:  # out of descriptors: strays make room, the collective's deadline bounds the rest
            _log.warning("bootstrap: rank %d cannot accept (%s)", self.rank, err)
            self._drop_oldest_pending(sel)
            time.sleep(0.01)
            return
        if len(self._pending) >= MAX_PENDING_HELLOS:
            self._drop_oldest_pending(sel)
        conn.setblocking(False)
        set_nodelay(conn)
        self._pending[conn] = FrameReader(HELLO_MAX_PAYLOAD)
        sel.register(conn, selectors.EVENT_READ, ("hello", conn))

    def _drop_oldest_pending(self, sel: selectors.BaseSelector) -> None:
        for conn in self._pending:
            del self._pending[conn]
            sel.unregister(conn)
            conn.close()
            return

    def _progress_hello(self, conn: socket.socket, sel: selectors.BaseSelector) -> int | None:
        """Reads an accepted connection's hello; returns the rank it came from once known."""
        try:
            frame = self._pending[conn].feed(conn)
            if frame is None:
                return None
            hello = frame.message()
            rank = hello.get("rank") if isinstance(hello, dict) else None
            if frame.kind != Kind.HELLO or hello.get("nonce") != self.nonce:
                raise BootstrapError("not a hello of this job")
            if not isinstance(rank, int) or not 0 <= rank < self.world or rank == self.rank or rank in self._in:
                raise BootstrapError(f"bad or duplicate rank {rank!r}")
        except (EOFError, OSError, BootstrapError, AttributeError) as exc:
            _log.warning("bootstrap: rank %d dropped a stray connection (%s)", self.rank, exc or "closed early")
            del self._pending[conn]
            sel.unregister(conn)
            conn.close()
            return None
        del self._pending[conn]
        sel.unregister(conn)
        self._in[rank] = conn
        return rank
