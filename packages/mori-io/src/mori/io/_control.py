"""The control plane: one TCP server per engine speaking length-prefixed msgpack frames.

Frame: a 4-byte big-endian length, then that many bytes of msgpack. A connection starts with
``{"op": "hello", "key": <engine key>, "token": <auth token>}`` answered by ``{"ok": true}``;
then each request ``{"op": str, "id": int, "body": map}`` gets ``{"id", "ok", "body"}`` or
``{"id", "ok": false, "code": StatusCode, "error": str}``. Anything else (bad length, not
msgpack, wrong shape, unknown op, wrong token) drops the connection; the server keeps serving
everyone else.

As in MORI, any engine that presents the auth token is served: registering a remote engine is
the initiator's step only, and each handler checks the request against what this engine has
registered (memory ids, offsets, sizes). The key a hello claims is bound to the engine that
proved it first (``_keys``).
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ._keys import MAX_PROOF, Identity, KeyBindings, Reach, challenge_answer, reach_hosts
from ._limits import Limits
from .types import StatusCode

__all__ = [
    "ProtocolError",
    "ControlError",
    "Request",
    "decode_request",
    "encode_frame",
    "ControlServer",
    "ControlClient",
    "ServerStats",
    "MAX_FRAME",
]

MAX_FRAME = 4 << 20
_HELLO_MAX = 16 << 10  # a hello holds a key and a token of at most 4096 characters each
_LEN = struct.Struct(">I")
_MAX_OP = 64


class ProtocolError(Exception):
    """A malformed control frame; the connection that sent it is dropped."""


class ControlError(ConnectionError):
    """A control request the peer refused or could not answer; ``code`` is a StatusCode."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    """A decoded control request (``id`` is 0 for hello)."""

    op: str
    id: int
    body: dict[str, Any]


def encode_frame(obj: Any) -> bytes:
    """Length prefix + msgpack of ``obj``."""
    data = msgpack.packb(obj, use_bin_type=True)
    if len(data) > MAX_FRAME:
        raise ValueError(f"control frame of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(data)) + data


def decode_request(data: bytes) -> Request:
    """Decodes one frame body into a :class:`Request`; raises :class:`ProtocolError` on anything
    malformed."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:
        raise ProtocolError(f"frame is not msgpack: {err}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a map")
    op = obj.get("op")
    if not isinstance(op, str) or not 0 < len(op) <= _MAX_OP:
        raise ProtocolError("frame has no valid 'op'")
    if op == "hello":
        return Request("hello", 0, _check_hello(obj))
    rid, body = obj.get("id"), obj.get("body")
    if (
        set(obj) != {"op", "id", "body"}
        or not isinstance(rid, int)
        or isinstance(rid, bool)
        or not 0 < rid < 1 << 63
        or not isinstance(body, dict)
    ):
        raise ProtocolError("malformed request")
    return Request(op, rid, body)


def _check_hello(obj: dict[str, Any]) -> dict[str, Any]:
    """The fields of a hello: ``key`` and ``token``, optionally the ``proof`` of the key
    (``_keys``) and ``reach``, ``{"host", "port"}`` of the claimant's own control plane."""
    proof, reach = obj.get("proof", ""), obj.get("reach")
    if (
        not {"op", "key", "token"} <= set(obj) <= {"op", "key", "token", "proof", "reach"}
        or not isinstance(obj["key"], str)
        or not obj["key"]
        or not isinstance(obj["token"], str)
        or not isinstance(proof, str)
        or len(proof) > MAX_PROOF
    ):
        raise ProtocolError("malformed hello")
    if reach is not None and not (
        isinstance(reach, dict)
        and set(reach) == {"host", "port"}
        and isinstance(reach["host"], str)
        and len(reach["host"]) <= 255
        and type(reach["port"]) is int
        and 0 < reach["port"] < 65536
    ):
        raise ProtocolError("malformed hello (reach)")
    return {"key": obj["key"], "token": obj["token"], "proof": proof, "reach": reach}


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    """``n`` bytes, all before ``deadline`` (monotonic): a peer trickling bytes cannot stretch it."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("control frame not received in time")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("control connection closed by peer")
        buf += chunk
    return bytes(buf)


def _recv_frame(
    sock: socket.socket, deadline: float, max_len: int = MAX_FRAME, budget: _ByteBudget | None = None
) -> bytes:
    """One frame, complete before ``deadline``; its length is charged to ``budget`` while it arrives."""
    (length,) = _LEN.unpack(_recv_exact(sock, 4, deadline))
    if not 0 < length <= max_len:
        raise ProtocolError(f"frame length {length} outside 1..{max_len}")
    if budget is None:
        return _recv_exact(sock, length, deadline)
    if not budget.take(length):
        raise ProtocolError(f"{length}-byte frame exceeds what the engine buffers now (MORI_IO_CONTROL_BUFFER)")
    try:
        return _recv_exact(sock, length, deadline)
    finally:
        budget.give(length)


class _ByteBudget:
    """Bytes of frames being received at once, over every connection of a server."""

    def __init__(self, total: int) -> None:
        self._left = total
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if n > self._left:
                return False
            self._left -= n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self._left += n


def _wait_readable(sock: socket.socket, timeout: float) -> bool:
    """Whether a byte (or the peer's close) arrives within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1, socket.MSG_PEEK) is not None
    except TimeoutError:
        return False


Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass
class _Conn:
    sock: socket.socket
    accepted: float
    authenticated: bool = False
    evicted: bool = False


@dataclass
class ServerStats:
    """What a server's limits turned away (see ``docs/io.md``, "Limits and hardening")."""

    refused: int = 0  # closed at accept: MORI_IO_MAX_CONNECTIONS reached
    evicted: int = 0  # dropped in their hello for newer connections (MORI_IO_MAX_HANDSHAKES)
    accept_errors: int = 0  # accept or thread start failed (descriptors, threads, memory)


class ControlServer:
    """Serves control requests for one engine (a thread per connection, within ``limits``).

    ``handlers`` maps op -> handler(remote key, body) -> reply body; the remote key is the one the
    authenticated peer gave in its hello. A handler raising :class:`ControlError` answers with its
    code; any other exception answers ERR_BAD_STATE.
    Connections beyond ``limits.max_connections`` are closed at once; past
    ``limits.max_handshakes`` connections in their hello, the oldest is dropped; a hello must
    arrive within ``limits.hello_timeout`` of the accept, each later frame within
    ``limits.io_timeout`` of its first byte, and a connection silent for ``limits.idle_timeout``
    is closed. Running out of descriptors or threads refuses connections until some close; the
    server never stops accepting.
    """

    def __init__(
        self, host: str, port: int, token: str, limits: Limits, log: Any, identity: Identity | None = None
    ) -> None:
        self._token = token.encode()
        self._limits = limits
        self._log = log
        self.handlers: dict[str, Handler] = {}
        self.stats = ServerStats()
        self._budget = _ByteBudget(limits.control_buffer)
        self._sock = socket.create_server((host, port), backlog=512, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._identity = identity
        self._host = host
        # Keys are bound to the first engine that proves them; without an identity of its own
        # this server cannot challenge a holder, so a holder with no connection counts as gone.
        self.bindings = KeyBindings(self._holder_answers if identity is not None else None)
        self._sock.settimeout(0.2)  # the accept loop wakes to notice close()
        self._stop = threading.Event()
        self._conns: dict[socket.socket, _Conn] = {}  # accept order
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"mori-io-control:{self.port}", daemon=True)
        self._thread.start()

    def connection_count(self) -> int:
        """Connections open now (handshaking or authenticated)."""
        with self._lock:
            return len(self._conns)

    def _evict_oldest_handshake(self) -> None:
        """Drops the oldest connection still in its hello (its thread then ends); lock held."""
        for entry in self._conns.values():
            if not entry.authenticated and not entry.evicted:
                entry.evicted = True
                self.stats.evicted += 1
                with contextlib.suppress(OSError):
                    entry.sock.shutdown(socket.SHUT_RDWR)
                return

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as err:
                if self._stop.is_set():
                    return
                # Out of descriptors (EMFILE/ENFILE), buffers or memory: free what a peer still in
                # its hello holds and back off (the queued connection stays, so a retry at once
                # would spin); keep accepting afterwards.
                with self._lock:
                    self._evict_oldest_handshake()
                    self.stats.accept_errors += 1
                self._log.debug("control: accept failed (%s); backing off", err)
                backoff = min(max(backoff * 2, 0.01), 0.2)
                time.sleep(backoff)
                continue
            backoff = 0.0
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        with self._lock:
            if self._stop.is_set() or len(self._conns) >= self._limits.max_connections:
                self.stats.refused += not self._stop.is_set()
                conn.close()
                return
            if sum(not c.authenticated for c in self._conns.values()) >= self._limits.max_handshakes:
                self._evict_oldest_handshake()
            entry = _Conn(conn, time.monotonic())
            self._conns[conn] = entry
        try:
            threading.Thread(target=self._serve, args=(entry,), daemon=True).start()
        except RuntimeError:  # no thread to be had: refuse this one, keep serving
            with self._lock:
                self._conns.pop(conn, None)
                self.stats.accept_errors += 1
            conn.close()

    def _hello(self, entry: _Conn) -> tuple[str, str]:
        """Checks the hello (token, then the key's proof); returns the authenticated key and its
        proof, which hold a claim on the key until :meth:`KeyBindings.release`."""
        conn = entry.sock
        hello = decode_request(_recv_frame(conn, entry.accepted + self._limits.hello_timeout, _HELLO_MAX))
        if hello.op != "hello":
            raise ProtocolError("first frame is not hello")
        key, proof, reach = hello.body["key"], hello.body["proof"], hello.body["reach"]
        refusal = None
        if not hmac.compare_digest(hello.body["token"].encode(), self._token):
            refusal = "rejected: auth token mismatch"
        else:
            peer = conn.getpeername()[0]
            refusal = self.bindings.claim(
                key, proof, None if reach is None else Reach(tuple(reach_hosts(reach["host"], peer)), reach["port"])
            )
        if refusal is not None:
            conn.sendall(encode_frame({"ok": False, "code": int(StatusCode.ERR_BAD_STATE), "error": refusal}))
            raise ProtocolError(f"engine {key!r}: {refusal}")
        with self._lock:
            evicted = entry.evicted
            entry.authenticated = not evicted
        if evicted:
            self.bindings.release(key, proof)
            raise ConnectionError("dropped during its hello")
        conn.settimeout(self._limits.io_timeout)
        conn.sendall(encode_frame({"ok": True}))
        return key, proof

    def _holder_answers(self, key: str, proof: str, reach: Reach) -> bool:
        """Whether the engine holding ``key`` with ``proof`` answers a challenge at ``reach``
        (each host tried within a third of the hello timeout)."""
        assert self._identity is not None
        nonce = secrets.token_hex(16)
        timeout = max(0.5, min(self._limits.hello_timeout, self._limits.io_timeout) / 3)
        for host in reach.hosts:
            try:
                client = ControlClient(
                    host,
                    reach.port,
                    self._identity.key,
                    self._token.decode(),
                    timeout,
                    proof=self._identity.proof_for(key),
                    reach=(self._host, self.port),
                )
            except (OSError, TimeoutError):
                continue
            try:
                reply = client.request("ping", {"nonce": nonce})
            except (OSError, TimeoutError):
                continue
            finally:
                client.close()
            if reply.get("key") == key and hmac.compare_digest(
                str(reply.get("answer", "")), challenge_answer(proof, nonce)
            ):
                return True
        return False

    def _serve(self, entry: _Conn) -> None:
        conn = entry.sock
        claim: tuple[str, str] | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            claim = self._hello(entry)
            key = claim[0]
            while not self._stop.is_set():
                if not _wait_readable(conn, self._limits.idle_timeout):
                    self._log.debug("control: closing connection of %r idle for %.0f s", key, self._limits.idle_timeout)
                    return
                req = decode_request(_recv_frame(conn, time.monotonic() + self._limits.io_timeout, budget=self._budget))
                conn.settimeout(self._limits.io_timeout)
                conn.sendall(encode_frame(self._answer(key, req)))
        except ProtocolError as err:
            self._log.debug("control: dropping connection: %s", err)
        except (OSError, ConnectionError):
            pass
        finally:
            if claim is not None:
                self.bindings.release(*claim)
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _answer(self, key: str, req: Request) -> dict[str, Any]:
        handler = self.handlers.get(req.op)
        if handler is None:
            raise ProtocolError(f"unknown op {req.op!r}")
        try:
            return {"id": req.id, "ok": True, "body": handler(key, req.body)}
        except ControlError as err:
            return {"id": req.id, "ok": False, "code": int(err.code), "error": str(err)}
        except Exception as err:  # a handler bug must not kill the server
            return {"id": req.id, "ok": False, "code": int(StatusCode.ERR_BAD_STATE), "error": repr(err)}

    def close(self) -> None:
        """Stops accepting and drops every connection."""
        self._stop.set()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)


class ControlClient:
    """One authenticated control connection to a remote engine; requests are serialized."""

    def __init__(
        self,
        host: str,
        port: int,
        my_key: str,
        token: str,
        timeout: float,
        proof: str = "",
        reach: tuple[str, int] | None = None,
    ) -> None:
        """Connects and says hello as ``my_key``, with the key's ``proof`` at that engine (see
        ``_keys``; "" claims the key unproven) and ``reach``, (host, port) of this engine's own
        control plane, where the target may challenge it if another engine claims its key."""
        self._timeout = timeout
        self._lock = threading.Lock()
        self._next_id = 1
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as err:
            raise ControlError(StatusCode.ERR_BAD_STATE, f"cannot reach engine at {host}:{port}: {err}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello: dict[str, Any] = {"op": "hello", "key": my_key, "token": token, "proof": proof}
        if reach is not None:
            hello["reach"] = {"host": reach[0], "port": reach[1]}
        reply = self._exchange(hello)
        if not reply.get("ok"):
            self.close()
            raise ControlError(StatusCode.ERR_BAD_STATE, str(reply.get("error", "hello rejected")))

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            self._sock.settimeout(self._timeout)
            self._sock.sendall(encode_frame(msg))
            reply = msgpack.unpackb(_recv_frame(self._sock, time.monotonic() + self._timeout), raw=False)
        except TimeoutError:
            raise TimeoutError(
                f"control request {msg.get('op')!r} got no answer in {self._timeout} s (MORI_IO_TIMEOUT)"
            ) from None
        except (OSError, ProtocolError) as err:
            raise ControlError(StatusCode.ERR_BAD_STATE, f"control connection failed: {err}") from None
        if not isinstance(reply, dict):
            raise ControlError(StatusCode.ERR_BAD_STATE, "control reply is not a map")
        return reply

    def request(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """Sends one request; returns the reply body or raises :class:`ControlError`/``TimeoutError``."""
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            reply = self._exchange({"op": op, "id": rid, "body": body})
        if reply.get("id") != rid:
            raise ControlError(StatusCode.ERR_BAD_STATE, "control reply out of order")
        if not reply.get("ok"):
            raise ControlError(StatusCode(reply.get("code", StatusCode.ERR_BAD_STATE)), str(reply.get("error")))
        body_out = reply.get("body")
        return body_out if isinstance(body_out, dict) else {}

    def close(self) -> None:
        """Closes the connection."""
        with contextlib.suppress(OSError):
            self._sock.close()
