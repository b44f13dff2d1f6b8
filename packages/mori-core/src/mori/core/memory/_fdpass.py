"""Passing file descriptors between processes over Unix sockets (``SCM_RIGHTS``).

``send_fds``/``recv_fds`` move a list of descriptors plus a small payload over a connected
``AF_UNIX`` stream socket, with a timeout on every wait. :class:`FdExchange` builds an all-gather
of descriptors among the ranks of a bootstrap that share this host, which is how shared heaps
(host segments, CUDA VMM allocations exported as fds) reach every local peer.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from typing import Protocol

import msgpack

from .. import config
from ..host import this_host
from ..log import get_logger

__all__ = ["send_fds", "recv_fds", "FdExchange"]

_log = get_logger("core.memory")
_MAGIC = b"MFD1"
_HEADER = struct.Struct("<4sII")  # magic, number of fds, payload length
_BATCH = 253  # SCM_MAX_FD: the kernel takes at most this many descriptors per message
_MAX_PAYLOAD = 1 << 20
_STRAY_WAIT_S = 0.5  # how long an accepted connection may take to deliver its message


def check_fd(fd: object, what: str) -> int:
    """Returns ``fd`` if it is an open file descriptor; raises :class:`ValueError` naming ``what`` otherwise."""
    if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
        raise ValueError(f"{what}: {fd!r} is not a file descriptor")
    try:
        os.fstat(fd)
    except OSError as err:
        raise ValueError(f"{what}: {fd} is not an open file descriptor ({err.strerror})") from None
    return fd


def _deadline(timeout: float | None) -> float:
    if timeout is None:
        timeout = float(config.get("MORI_BOOTSTRAP_TIMEOUT"))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return time.monotonic() + timeout


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"timed out {what}")
    return left


def send_fds(sock: socket.socket, fds: Sequence[int], payload: bytes = b"", timeout: float | None = None) -> None:
    """Sends ``fds`` (any number) and ``payload`` (up to 1 MiB) over a connected Unix stream socket.

    The receiver gets duplicates of the descriptors; the caller's stay open. ``timeout`` (seconds,
    default ``MORI_BOOTSTRAP_TIMEOUT``) bounds the whole send.
    """
    if sock.family != socket.AF_UNIX:
        raise ValueError(f"send_fds needs an AF_UNIX socket, got {sock.family!r}")
    fds = [check_fd(fd, "send_fds") for fd in fds]
    if len(payload) > _MAX_PAYLOAD:
        raise ValueError(f"send_fds: payload of {len(payload)} bytes exceeds the {_MAX_PAYLOAD}-byte limit")
    deadline = _deadline(timeout)
    previous = sock.gettimeout()
    try:
        data = _HEADER.pack(_MAGIC, len(fds), len(payload)) + bytes(payload)
        # The descriptors ride on the first byte of each message; the kernel never merges a
        # message that carries descriptors with the next one on receive.
        sock.settimeout(_remaining(deadline, "sending descriptors"))
        sent = socket.send_fds(sock, [data], fds[:_BATCH])
        while sent < len(data):
            sock.settimeout(_remaining(deadline, "sending descriptors"))
            sent += sock.send(data[sent:])
        for start in range(_BATCH, len(fds), _BATCH):
            sock.settimeout(_remaining(deadline, "sending descriptors"))
            socket.send_fds(sock, [b"+"], fds[start : start + _BATCH])
    except TimeoutError:
        raise TimeoutError(f"send_fds: the peer did not take {len(fds)} descriptor(s) in time") from None
    finally:
        sock.settimeout(previous)


def _recv_exact(sock: socket.socket, n: int, deadline: float, fds: list[int]) -> bytes:
    """Reads exactly ``n`` bytes, collecting any descriptors that arrive with them into ``fds``."""
    chunks, got = [], 0
    while got < n:
        what = f"waiting for {n - got} more byte(s) of a descriptor message"
        sock.settimeout(_remaining(deadline, what))
        try:
            data, anc, flags, _ = sock.recvmsg(n - got, socket.CMSG_SPACE(_BATCH * 4))
        except TimeoutError:
            raise TimeoutError(f"recv_fds: timed out {what}") from None
        for level, kind, blob in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(struct.unpack(f"{len(blob) // 4}i", blob[: len(blob) - len(blob) % 4]))
        if flags & socket.MSG_CTRUNC:
            raise OSError("recv_fds: descriptors were truncated (the process may be out of file descriptors)")
        if not data:
            raise ConnectionError(f"recv_fds: the peer closed the connection with {n - got} byte(s) missing")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def recv_fds(sock: socket.socket, timeout: float | None = None) -> tuple[bytes, list[int]]:
    """Receives one :func:`send_fds` message: returns ``(payload, fds)``; the caller owns the fds.

    Raises :class:`TimeoutError` when the message does not arrive within ``timeout`` seconds
    (default ``MORI_BOOTSTRAP_TIMEOUT``), :class:`ConnectionError` when the peer hangs up, and
    :class:`ValueError` on a malformed message; descriptors received before an error are closed.
    """
    if sock.family != socket.AF_UNIX:
        raise ValueError(f"recv_fds needs an AF_UNIX socket, got {sock.family!r}")
    deadline = _deadline(timeout)
    previous = sock.gettimeout()
    fds: list[int] = []
    try:
        magic, count, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline, fds))
        if magic != _MAGIC or length > _MAX_PAYLOAD:
            raise ValueError(f"recv_fds: not a mori descriptor message (header {magic!r}, payload {length})")
        payload = _recv_exact(sock, length, deadline, fds) if length else b""
        while len(fds) < count:
            if _recv_exact(sock, 1, deadline, fds) != b"+":
                raise ValueError("recv_fds: malformed continuation of a descriptor message")
        if len(fds) != count:
            raise ValueError(f"recv_fds: expected {count} descriptors, received {len(fds)}")
        for fd in fds:
            os.set_inheritable(fd, False)
        return payload, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.settimeout(previous)


class Collective(Protocol):
    """What :class:`FdExchange` needs from a bootstrap: rank, world and an all-gather of bytes."""

    rank: int
    world: int

    def allgather(self, data: bytes) -> list[bytes]: ...


class FdExchange:
    """All-gather of file descriptors among the ranks of a bootstrap that run on this host.

    Every rank listens on an abstract Unix socket whose name, with a per-rank secret, is shared
    through ``bootstrap.allgather``; a message is accepted only with its sender's secret, so no
    other local process can inject descriptors. Construct on every rank (a collective), then call
    :meth:`allgather_fds` on every rank in the same order. Ranks on other hosts appear in
    :attr:`local_ranks` as absent and get empty lists.
    """

    def __init__(self, bootstrap: Collective, timeout: float | None = None):
        _deadline(timeout)  # validate now, not at the first exchange
        self._bs, self._timeout = bootstrap, timeout
        self.rank, self.world = bootstrap.rank, bootstrap.world
        self._secret = secrets.token_bytes(16)
        name = f"\0mori-fdx-{os.getpid()}-{secrets.token_hex(8)}"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(name)
            # A rank is at most one exchange ahead of another, so 2 * world pending connections suffice.
            self._listener.listen(2 * self.world + 8)
            mine = {"host": this_host().key, "name": name, "secret": self._secret}
            self._peers = [msgpack.unpackb(b) for b in bootstrap.allgather(msgpack.packb(mine))]
        except BaseException:
            self._listener.close()
            raise
        self.local_ranks: list[int] = [r for r, p in enumerate(self._peers) if p["host"] == mine["host"]]
        self._seq = 0
        self._stash: dict[tuple[int, int], list[int]] = {}

    def allgather_fds(self, my_fds: Sequence[int]) -> list[list[int]]:
        """Sends ``my_fds`` to every local rank; returns ``[rank] -> that rank's fds`` (the caller owns all).

        This rank's own entry holds duplicates of ``my_fds``; ranks on other hosts get ``[]``.
        Raises :class:`TimeoutError` naming the ranks that did not deliver in time.
        """
        if self._listener.fileno() < 0:
            raise ValueError("FdExchange is closed")
        my_fds = list(my_fds)
        deadline = _deadline(self._timeout)
        seq, self._seq = self._seq, self._seq + 1
        payload = msgpack.packb([self.rank, seq, self._secret])
        for r in self.local_ranks:
            if r == self.rank:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
                s.settimeout(_remaining(deadline, f"connecting to rank {r} to pass descriptors"))
                try:
                    s.connect(self._peers[r]["name"])
                except OSError as err:
                    raise ConnectionError(f"FdExchange: cannot reach rank {r}'s descriptor socket: {err}") from None
                send_fds(s, my_fds, payload, timeout=_remaining(deadline, f"sending descriptors to rank {r}"))
        result: list[list[int]] = [[] for _ in range(self.world)]
        result[self.rank] = [os.dup(fd) for fd in my_fds]
        missing = {r for r in self.local_ranks if r != self.rank}
        for r in list(missing):
            if (seq, r) in self._stash:
                result[r] = self._stash.pop((seq, r))
                missing.discard(r)
        try:
            while missing:
                self._receive_one(seq, deadline, result, missing)
        except BaseException:
            for fds in result:
                for fd in fds:
                    os.close(fd)
            raise
        return result

    def _receive_one(self, seq: int, deadline: float, result: list[list[int]], missing: set[int]) -> None:
        pending = ", ".join(map(str, sorted(missing)))
        try:
            self._listener.settimeout(_remaining(deadline, f"waiting for descriptors from rank(s) {pending}"))
            conn, _ = self._listener.accept()
        except TimeoutError:
            raise TimeoutError(f"FdExchange: timed out waiting for descriptors from rank(s) {pending}") from None
        with conn:
            try:
                # Peers send the moment they connect: a silent stranger gets half a second, not the
                # whole deadline, so it cannot make this exchange miss the ranks behind it.
                wait = min(_STRAY_WAIT_S, _remaining(deadline, f"receiving descriptors from {pending}"))
                payload, fds = recv_fds(conn, timeout=wait)
            except (ValueError, ConnectionError, TimeoutError) as err:
                # Not from a peer rank (they always send whole messages): ignore, keep waiting.
                _log.warning("FdExchange: dropped a malformed descriptor message: %s", err)
                return
        try:
            rank, their_seq, secret = msgpack.unpackb(payload)
            valid = 0 <= rank < self.world and secrets.compare_digest(secret, self._peers[rank]["secret"])
        except (ValueError, TypeError, msgpack.UnpackException):
            valid = False
        if not valid:
            _log.warning("FdExchange: dropped a descriptor message without a valid rank secret")
            for fd in fds:
                os.close(fd)
        elif their_seq == seq and rank in missing:
            result[rank] = fds
            missing.discard(rank)
        elif their_seq > seq:
            self._stash[(their_seq, rank)] = fds  # that rank is already one exchange ahead
        else:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        """Closes the listening socket and any descriptors received ahead of time. Idempotent."""
        self._listener.close()
        for fds in self._stash.values():
            for fd in fds:
                os.close(fd)
        self._stash.clear()

    def __enter__(self) -> FdExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
