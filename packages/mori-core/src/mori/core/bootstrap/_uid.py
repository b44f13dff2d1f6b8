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

Any process may make the id, as in MORI and NCCL: rank 0 itself, a launcher that is no rank, or
the main thread of a process whose threads are the ranks. The maker binds the port (without
listening) before the id travels, so no other program can take it; rank 0 then listens on it:
the same socket when rank 0 runs in the maker's process, else a socket of its own bound to the
same port beside the reservation (``SO_REUSEPORT``; only listening sockets receive connections,
so every rank reaches rank 0). Ranks that arrive before rank 0 listens are refused and retry.
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
# Reservations kept per process: a launcher that makes ids in a loop holds at most this many
# ports (the oldest is released first; its rank 0 then binds the port afresh).
_MAX_RESERVED = 64

# Sockets bound by get_unique_id in this process, waiting for rank 0 to adopt them (insertion order).
_reserved: dict[bytes, socket.socket] = {}
_reserved_lock = threading.Lock()


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


def _bound(host: str, port: int, share: bool) -> socket.socket:
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if share:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        elif port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP listening socket bound to ``host:port`` (port 0: any free port)."""
    sock = _bound(host, port, share=False)
    try:
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def get_unique_id() -> bytes:
    """Makes a new job's 128-byte unique id and reserves rank 0's port in this process.

    Any process may call it: rank 0's, a launcher's that is no rank, or a process whose threads
    are the ranks. Send the bytes to the ranks by any means (a launcher, ``torch.distributed``,
    MPI, a file); keep this process alive until rank 0 has initialized, or the reservation lapses
    (rank 0 still binds the port then, unless another program took it meanwhile). The address is
    ``MORI_BOOTSTRAP_HOST`` or the host's outward address (loopback when it has none).
    """
    host = _host_address()
    try:
        sock = _bound(host, 0, share=True)
    except OSError as exc:
        raise BootstrapError(f"cannot bind a port on {host} for the bootstrap: {exc}") from exc
    uid = UniqueId(host, sock.getsockname()[1], os.urandom(16))
    with _reserved_lock:
        _reserved[uid.nonce] = sock
        while len(_reserved) > _MAX_RESERVED:
            _reserved.pop(next(iter(_reserved))).close()
    return uid.to_bytes()


def _someone_listens(uid: UniqueId) -> bool:
    try:
        with socket.create_connection((uid.host, uid.port), timeout=1.0):
            return True
    except OSError:
        return False


def take_listener(uid: UniqueId) -> socket.socket:
    """Rank 0's listening socket on the id's port: the reservation :func:`get_unique_id` made in
    this process, else a socket of its own bound beside the reservation of the process that made
    the id. The caller owns the socket (:class:`Bootstrap` takes it for rank 0). Raises
    :class:`BootstrapError` naming the address when something already listens there or the port
    cannot be bound."""
    with _reserved_lock:
        sock = _reserved.pop(uid.nonce, None)
    try:
        if sock is None:
            if _someone_listens(uid):  # another rank 0 of this id, or an unrelated server
                raise OSError(f"another process already listens on port {uid.port}")
            sock = _bound(uid.host, uid.port, share=True)
        sock.listen(_BACKLOG)
        return sock
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise BootstrapError(
            f"rank 0 cannot listen on {uid.host}:{uid.port} named by the unique id ({exc}); "
            "make a new id with get_unique_id(), or free that port"
        ) from exc
