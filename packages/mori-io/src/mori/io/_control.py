"""The control plane: one TCP server per engine speaking length-prefixed msgpack frames.

Frame: a 4-byte big-endian length, then that many bytes of msgpack. A connection starts with
``{"op": "hello", "key": <engine key>, "token": <auth token>}`` answered by ``{"ok": true}``;
then each request ``{"op": str, "id": int, "body": map}`` gets ``{"id", "ok", "body"}`` or
``{"id", "ok": false, "code": StatusCode, "error": str}``. Anything else (bad length, not
msgpack, wrong shape, unknown op, wrong token) drops the connection; the server keeps serving
everyone else.

As in MORI, any engine that presents the auth token is served: registering a remote engine is
the initiator's step only, and each handler checks the request against what this engine has
registered (memory ids, offsets, sizes).
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .types import StatusCode

__all__ = ["ProtocolError", "ControlError", "Request", "decode_request", "encode_frame", "ControlServer",
           "ControlClient", "MAX_FRAME"]

MAX_FRAME = 4 << 20
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
        if set(obj) != {"op", "key", "token"} or not isinstance(obj["key"], str) or not obj["key"] \
                or not isinstance(obj["token"], str):
            raise ProtocolError("malformed hello")
        return Request("hello", 0, {"key": obj["key"], "token": obj["token"]})
    rid, body = obj.get("id"), obj.get("body")
    if set(obj) != {"op", "id", "body"} or not isinstance(rid, int) or isinstance(rid, bool) \
            or not 0 < rid < 1 << 63 or not isinstance(body, dict):
        raise ProtocolError("malformed request")
    return Request(op, rid, body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("control connection closed by peer")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_recv_exact(sock, 4))
    if not 0 < length <= MAX_FRAME:
        raise ProtocolError(f"frame length {length} outside 1..{MAX_FRAME}")
    return _recv_exact(sock, length)


Handler = Callable[[str, dict[str, Any]], dict[str, Any]]


class ControlServer:
    """Serves control requests for one engine (a thread per connection).

    ``handlers`` maps op -> handler(remote key, body) -> reply body; the remote key is the one the
    authenticated peer gave in its hello. A handler raising :class:`ControlError` answers with its
    code; any other exception answers ERR_BAD_STATE.
    """

    def __init__(self, host: str, port: int, token: str, hello_timeout: float, log: Any) -> None:
        self._token = token.encode()
        self._hello_timeout = hello_timeout
        self._log = log
        self.handlers: dict[str, Handler] = {}
        self._sock = socket.create_server((host, port), backlog=512, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._sock.settimeout(0.2)  # the accept loop wakes to notice close()
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name=f"mori-io-control:{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._hello_timeout)
            hello = decode_request(_recv_frame(conn))
            if hello.op != "hello":
                raise ProtocolError("first frame is not hello")
            if not hmac.compare_digest(hello.body["token"].encode(), self._token):
                conn.sendall(encode_frame({"ok": False, "code": int(StatusCode.ERR_BAD_STATE),
                                           "error": "rejected: auth token mismatch"}))
                raise ProtocolError(f"engine {hello.body['key']!r} presented a wrong auth token")
            key = hello.body["key"]
            conn.sendall(encode_frame({"ok": True}))
            conn.settimeout(None)
            while not self._stop.is_set():
                req = decode_request(_recv_frame(conn))
                conn.sendall(encode_frame(self._answer(key, req)))
        except ProtocolError as err:
            self._log.debug("control: dropping connection: %s", err)
        except (OSError, ConnectionError):
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
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

    def __init__(self, host: str, port: int, my_key: str, token: str, timeout: float) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._next_id = 1
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as err:
            raise ControlError(StatusCode.ERR_BAD_STATE, f"cannot reach engine at {host}:{port}: {err}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reply = self._exchange({"op": "hello", "key": my_key, "token": token})
        if not reply.get("ok"):
            self.close()
            raise ControlError(StatusCode.ERR_BAD_STATE, str(reply.get("error", "hello rejected")))

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            self._sock.sendall(encode_frame(msg))
            reply = msgpack.unpackb(_recv_frame(self._sock), raw=False)
        except TimeoutError:
            raise TimeoutError(f"control request {msg.get('op')!r} got no answer in {self._timeout} s "
                               "(MORI_IO_TIMEOUT)") from None
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
