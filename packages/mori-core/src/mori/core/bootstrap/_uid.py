"""The 128-byte unique id that tells every rank where rank 0 listens.

Layout (network byte order)::

    [0, 4)     magic  b"MORI"
    [4, 6)     version (1)
    [6]        address family: 4 or 6
    [7]        reserved, 0
    [8, 10)    port
    [10, 26)   address (IPv4 in the first 4 bytes)
    [26, 42)   nonce: 16 random bytes naming this job
    [42, 124)  reserved, 0
    [124, 128) CRC-32 of bytes [0, 124)

As in NCCL, the process that makes the id also opens rank 0's listening socket, so the port is
taken before the id travels; rank 0's :class:`~mori.core.bootstrap.Bootstrap` adopts it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import zlib
from dataclasses import dataclass

from .. import config
from ._errors import BootstrapError

__all__ = ["UNIQUE_ID_BYTES", "UniqueId", "get_unique_id", "listen", "take_listener"]

UNIQUE_ID_BYTES = 128
_MAGIC = b"MORI"
_VERSION = 1
_HEAD = struct.Struct("!4sHBBH16s16s")
_BODY = UNIQUE_ID_BYTES - 4
_BACKLOG = 4096

# Listening sockets made by get_unique_id in this process, waiting for rank 0 to adopt them.
_listeners: dict[bytes, socket.socket] = {}
_listeners_lock = threading.Lock()


@dataclass(frozen=True)
class UniqueId:
    """Where rank 0 listens (``host``, ``port``) and the ``nonce`` that names the job."""

    host: str
    port: int
    nonce: bytes

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise BootstrapError(f"unique id host {self.host!r} is not an IPv4 or IPv6 address") from None
        if not 0 < self.port < 65536:
            raise BootstrapError(f"unique id port {self.port} is outside 1..65535")
        if len(self.nonce) != 16:
            raise BootstrapError(f"unique id nonce must be 16 bytes, got {len(self.nonce)}")

    def to_bytes(self) -> bytes:
        """The 128-byte wire form."""
        addr = ipaddress.ip_address(self.host)
        head = _HEAD.pack(_MAGIC, _VERSION, addr.version, 0, self.port, addr.packed.ljust(16, b"\0"), self.nonce)
        body = head.ljust(_BODY, b"\0")
        return body + struct.pack("!I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> UniqueId:
        """Parses the wire form; a wrong length, magic, version or checksum raises :class:`BootstrapError`."""
        data = bytes(data)
        if len(data) != UNIQUE_ID_BYTES:
            raise BootstrapError(f"a mori unique id is {UNIQUE_ID_BYTES} bytes, got {len(data)}")
        magic, version, family, _, port, raw_addr, nonce = _HEAD.unpack_from(data)
        if magic != _MAGIC:
            raise BootstrapError(f"not a mori unique id: magic {magic!r}, expected {_MAGIC!r}")
        if version != _VERSION:
            raise BootstrapError(f"unique id version {version} is not supported (this mori reads version {_VERSION})")
        (crc,) = struct.unpack_from("!I", data, _BODY)
        if crc != zlib.crc32(data[:_BODY]):
            raise BootstrapError("unique id is corrupt: its checksum does not match its contents")
        if family == 4:
            host = str(ipaddress.IPv4Address(raw_addr[:4]))
        elif family == 6:
            host = str(ipaddress.IPv6Address(raw_addr))
        else:
            raise BootstrapError(f"unique id address family {family} is neither 4 nor 6")
        return cls(host, port, nonce)

    @classmethod
    def coerce(cls, uid: UniqueId | bytes | bytearray | memoryview) -> UniqueId:
        """Accepts a :class:`UniqueId` or its bytes."""
        if isinstance(uid, UniqueId):
            return uid
        if isinstance(uid, (bytes, bytearray, memoryview)):
            return cls.from_bytes(uid)
        raise TypeError(f"unique id must be bytes or UniqueId, got {type(uid).__name__}")


def _outward_address() -> str:
    """The address this host uses to reach the outside, or loopback when it has no route."""
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))  # UDP connect sends nothing; it only picks the route.
                addr = str(s.getsockname()[0])
        except OSError:
            continue
        if not ipaddress.ip_address(addr).is_unspecified:
            return addr
    return "127.0.0.1"


def _host_address() -> str:
    configured = config.get("MORI_BOOTSTRAP_HOST")
    if not configured:
        return _outward_address()
    try:
        infos = socket.getaddrinfo(configured.strip(), None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise config.ConfigError(
            f"MORI_BOOTSTRAP_HOST={configured!r} is not an address this host can resolve ({exc})"
        ) from None
    return str(infos[0][4][0])


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP listening socket bound to ``host:port`` (port 0: any free port)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def get_unique_id() -> bytes:
    """Makes a new job's 128-byte unique id and opens rank 0's listening socket in this process.

    Call it in the process that will be rank 0 and send the bytes to the other ranks by any means
    (a launcher, ``torch.distributed``, MPI, a file). The address is ``MORI_BOOTSTRAP_HOST`` or the
    host's outward address (loopback when it has none).
    """
    host = _host_address()
    try:
        sock = listen(host)
    except OSError as exc:
        raise BootstrapError(f"cannot listen on {host} for the bootstrap: {exc}") from exc
    uid = UniqueId(host, sock.getsockname()[1], os.urandom(16))
    with _listeners_lock:
        _listeners[uid.nonce] = sock
    return uid.to_bytes()


def take_listener(uid: UniqueId) -> socket.socket:
    """Rank 0's listening socket: the one :func:`get_unique_id` opened here, else a fresh bind to the id's port.

    The caller owns the socket. :class:`Bootstrap` takes it for rank 0; a launcher whose rank 0 is
    another process (``python -m mori.shmem.run``) takes it and closes it, so that rank 0 binds the
    same port. Raises :class:`BootstrapError` naming the address when that port cannot be bound.
    """
    with _listeners_lock:
        sock = _listeners.pop(uid.nonce, None)
    if sock is not None:
        return sock
    try:
        return listen(uid.host, uid.port)
    except OSError as exc:
        raise BootstrapError(
            f"rank 0 cannot listen on {uid.host}:{uid.port} named by the unique id ({exc}); "
            "call get_unique_id() in rank 0's process, or free that port"
        ) from exc
