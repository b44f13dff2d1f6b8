"""Rendezvous: every rank connects to rank 0, which checks them and hands out the rank table.

A joining rank sends a HELLO with the job's nonce, its rank, the world size and the address it
listens on. Rank 0 rejects a rank with another job's nonce, a wrong world size, an out-of-range or
duplicate rank (the rejected process gets an ERROR naming why), waits until every rank has
joined, and answers each with the TABLE of all ranks' addresses. When time runs out it tells the
ranks that did join which ones are missing, so every rank's error names them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import time
from dataclasses import dataclass

from .. import log
from ._errors import BootstrapError, BootstrapTimeout
from ._uid import UniqueId, listen
from ._wire import (
    HELLO_MAX_PAYLOAD,
    MAX_PENDING_HELLOS,
    Deadline,
    FrameReader,
    Kind,
    encode,
    raise_peer_error,
    recv_frame,
    send_frame,
)

__all__ = ["RankInfo", "serve", "join", "connect", "set_nodelay"]

_log = log.get_logger("core.bootstrap")
# How much longer a joining rank waits than rank 0 does, so that rank 0's report of which ranks
# are missing reaches it before its own clock runs out.
_REPORT_GRACE_S = 2.0


@dataclass(frozen=True)
class RankInfo:
    """Where one rank listens, and which process it is (for error messages)."""

    host: str
    port: int
    pid: int
    hostname: str

    def describe(self, rank: int) -> str:
        """``rank 3 (pid 1234 on node7)``."""
        return f"rank {rank} (pid {self.pid} on {self.hostname})"


def set_nodelay(sock: socket.socket) -> None:
    """Small control frames must leave at once, not wait for Nagle's algorithm."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(host: str, port: int, deadline: Deadline, retry_refused: bool) -> socket.socket:
    """A blocking TCP connect to ``host:port`` that gives up at ``deadline``.

    With ``retry_refused`` a refused connection is tried again until then (rank 0 may not be
    listening yet); without it a refusal raises ``ConnectionRefusedError`` at once.
    """
    pause = 0.01
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(deadline.remaining(), 0.001))
        except ConnectionRefusedError:
            if not retry_refused or deadline.expired():
                raise
            time.sleep(min(pause, deadline.remaining()))
            pause = min(pause * 2, 0.5)
            continue
        set_nodelay(sock)
        return sock


def _hello(uid: UniqueId, rank: int, world: int, host: str, port: int) -> bytes:
    return encode(
        {
            "nonce": uid.nonce,
            "rank": rank,
            "world": world,
            "host": host,
            "port": port,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }
    )


def _self_info(listener: socket.socket) -> RankInfo:
    host, port = listener.getsockname()[:2]
    return RankInfo(host, port, os.getpid(), socket.gethostname())


def join(uid: UniqueId, rank: int, world: int, timeout: float) -> tuple[list[RankInfo], socket.socket, socket.socket]:
    """A rank other than 0 joins: returns the rank table, its socket to rank 0 and its listener."""
    deadline = Deadline(timeout)
    where = f"rank 0 at {uid.host}:{uid.port}"
    try:
        sock = connect(uid.host, uid.port, deadline, retry_refused=True)
    except ConnectionRefusedError:
        raise BootstrapTimeout(
            f"ranks [0] did not arrive within {timeout:g} s: nothing listens at {uid.host}:{uid.port}"
        ) from None
    except OSError as exc:
        if isinstance(exc, TimeoutError) or exc.errno == errno.ETIMEDOUT:
            raise BootstrapTimeout(
                f"ranks [0] did not arrive within {timeout:g} s: cannot connect to {where}"
            ) from None
        raise BootstrapError(f"cannot connect to {where}: {exc}") from exc
    listener = None
    try:
        # Listen on the interface that reaches rank 0: the other ranks can reach it too.
        listener = listen(sock.getsockname()[0])
        me = _self_info(listener)
        send_frame(sock, Kind.HELLO, _hello(uid, rank, world, me.host, me.port), deadline)
        frame = recv_frame(sock, Deadline(deadline.remaining() + min(timeout, _REPORT_GRACE_S)))
        if frame is None:
            raise BootstrapTimeout(
                f"ranks [0] did not complete the rendezvous within {timeout:g} s: {where} "
                "never answered (it did not arrive, or it is still waiting for others)"
            )
        if frame.kind == Kind.ERROR:
            raise_peer_error(frame, where)
        if frame.kind != Kind.TABLE:
            raise BootstrapError(f"{where} answered with frame kind {frame.kind}, expected the rank table")
        table = [RankInfo(*row) for row in frame.message()]
        if len(table) != world:
            raise BootstrapError(f"{where} sent a table of {len(table)} ranks, expected {world}")
        return table, sock, listener
    except EOFError:
        sock.close()
        if listener is not None:
            listener.close()
        raise BootstrapError(f"{where} closed the connection during the rendezvous (it exited or failed)") from None
    except BaseException:
        sock.close()
        if listener is not None:
            listener.close()
        raise


class _Server:
    """Rank 0's side of the rendezvous."""

    def __init__(self, uid: UniqueId, listener: socket.socket, world: int, timeout: float) -> None:
        self.uid, self.listener, self.world, self.timeout = uid, listener, world, timeout
        self.joined: dict[int, tuple[socket.socket, RankInfo]] = {}
        self.rejected: list[str] = []
        self.sel = selectors.DefaultSelector()

    def run(self) -> tuple[list[RankInfo], dict[int, socket.socket]]:
        deadline = Deadline(self.timeout)
        self.listener.setblocking(False)
        self.sel.register(self.listener, selectors.EVENT_READ, None)
        try:
            while len(self.joined) < self.world - 1:
                events = self.sel.select(deadline.remaining())
                if not events and deadline.expired():
                    self._fail_timeout()
                for key, _ in events:
                    if key.data is None:
                        self._accept()
                    elif isinstance(key.data, FrameReader):
                        self._read_hello(key.fileobj, key.data)  # type: ignore[arg-type]
                    else:
                        self._check_alive(key.data)
            table = [_self_info(self.listener)] + [self.joined[r][1] for r in range(1, self.world)]
            rows = encode([[i.host, i.port, i.pid, i.hostname] for i in table])
            for sock, _ in self.joined.values():
                if sock in self.sel.get_map():
                    self.sel.unregister(sock)
                send_frame(sock, Kind.TABLE, rows, deadline)
            return table, {r: s for r, (s, _) in self.joined.items()}
        except BaseException:
            for sock, _ in self.joined.values():
                sock.close()
            raise
        finally:
            for key in list(self.sel.get_map().values()):
                if isinstance(key.data, FrameReader):
                    key.fileobj.close()  # type: ignore[union-attr]
            self.sel.close()

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as err:  # out of descriptors: strays make room, the deadline bounds the rest
            _log.warning("bootstrap: rank 0 cannot accept (%s)", err)
            self._drop_oldest_stray()
            time.sleep(0.01)
            return
        strays = [k.fileobj for k in self.sel.get_map().values() if isinstance(k.data, FrameReader)]
        if len(strays) >= MAX_PENDING_HELLOS:
            self._drop_oldest_stray()
        conn.setblocking(False)
        set_nodelay(conn)
        self.sel.register(conn, selectors.EVENT_READ, FrameReader(HELLO_MAX_PAYLOAD))

    def _drop_oldest_stray(self) -> None:
        """Closes the longest-waiting connection that has not sent its hello yet (accept order)."""
        for key in list(self.sel.get_map().values()):
            if isinstance(key.data, FrameReader):
                self._drop(key.fileobj)  # type: ignore[arg-type]
                return

    def _drop(self, conn: socket.socket) -> None:
        self.sel.unregister(conn)
        conn.close()

    def _read_hello(self, conn: socket.socket, reader: FrameReader) -> None:
        try:
            peer = "a process at {}:{}".format(*conn.getpeername()[:2])
        except OSError:
            peer = "a process"
        try:
            frame = reader.feed(conn)
            if frame is None:
                return
            hello = frame.message()
        except (EOFError, OSError, BootstrapError) as exc:
            _log.warning("bootstrap: dropped %s before it introduced itself (%s)", peer, exc or "closed")
            self._drop(conn)
            return
        if frame.kind != Kind.HELLO or not isinstance(hello, dict):
            _log.warning("bootstrap: dropped %s: it did not start with a hello", peer)
            self._drop(conn)
            return
        rank = hello.get("rank")
        problem = self._judge(hello)
        if problem is not None:
            reason = f"rank 0 at {self.uid.host}:{self.uid.port} rejected rank {rank} from {peer}: {problem}"
            _log.warning("bootstrap: %s", reason)
            self.rejected.append(f"rank {rank} ({problem})")
            with contextlib.suppress(OSError):
                send_frame(conn, Kind.ERROR, encode({"message": reason}), Deadline(1.0))
            self._drop(conn)
            return
        assert isinstance(rank, int)
        info = RankInfo(str(hello["host"]), int(hello["port"]), int(hello["pid"]), str(hello["hostname"]))
        self.joined[rank] = (conn, info)
        self.sel.modify(conn, selectors.EVENT_READ, rank)
        _log.debug("bootstrap: %s joined (%d of %d)", info.describe(rank), len(self.joined) + 1, self.world)

    def _judge(self, hello: dict) -> str | None:
        rank, world = hello.get("rank"), hello.get("world")
        if hello.get("nonce") != self.uid.nonce:
            return "its unique id belongs to another job (nonce mismatch)"
        fields = {"host": str, "port": int, "pid": int, "hostname": str}
        if any(not isinstance(hello.get(k), t) for k, t in fields.items()):
            return "its hello lacks a listening address, pid or host name"
        if world != self.world:
            return f"it says world={world} but rank 0 has world={self.world}"
        if not isinstance(rank, int) or not 0 <= rank < self.world:
            return f"rank {rank!r} is outside 0..{self.world - 1}"
        if rank == 0:
            return "rank 0 is this process (duplicate rank 0)"
        if rank in self.joined:
            return f"duplicate: {self.joined[rank][1].describe(rank)} already joined"
        return None

    def _check_alive(self, rank: int) -> None:
        """A joined rank has nothing to say before the table; readable means it went away."""
        conn, info = self.joined[rank]
        try:
            alive = conn.recv(1, socket.MSG_PEEK) != b""
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            alive = False
        self.sel.unregister(conn)
        if not alive:
            _log.warning("bootstrap: %s joined and then disconnected", info.describe(rank))
            self.rejected.append(f"{info.describe(rank)} joined and then disconnected")
            del self.joined[rank]
            conn.close()

    def _fail_timeout(self) -> None:
        missing = sorted(set(range(1, self.world)) - set(self.joined))
        message = f"ranks {missing} did not join within {self.timeout:g} s"
        if self.rejected:
            message += "; rejected: " + "; ".join(self.rejected)
        for sock, _ in self.joined.values():
            with contextlib.suppress(OSError):
                send_frame(sock, Kind.ERROR, encode({"message": message, "timeout": True}), Deadline(1.0))
        raise BootstrapTimeout(message)


def serve(
    uid: UniqueId, listener: socket.socket, world: int, timeout: float
) -> tuple[list[RankInfo], dict[int, socket.socket]]:
    """Rank 0 runs the rendezvous: returns the rank table and its socket from each rank."""
    return _Server(uid, listener, world, timeout).run()
