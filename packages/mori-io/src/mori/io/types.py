"""Public value types of mori-io: enums, configurations, descriptors and :class:`TransferStatus`.

Names follow MORI's Python API (``BackendType.XGMI``, ``StatusCode.ERR_NOT_FOUND``,
``TransferStatus.Succeeded()``...) so code written for MORI runs unchanged.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import msgpack

__all__ = [
    "BackendType",
    "MemoryLocationType",
    "StatusCode",
    "PollCqMode",
    "IOEngineConfig",
    "RdmaBackendConfig",
    "XgmiBackendConfig",
    "TcpBackendConfig",
    "EngineDesc",
    "MemoryDesc",
    "TransferStatus",
]


class BackendType(enum.IntEnum):
    """A transfer medium. ``XGMI`` is MORI's name for the intra-node GPU link; on NVIDIA GPUs it
    is NVLink, so ``NVLINK`` is the same member."""

    Unknown = 0
    XGMI = 1
    NVLINK = 1
    RDMA = 2
    TCP = 3


class MemoryLocationType(enum.IntEnum):
    """Where registered memory lives."""

    Unknown = 0
    CPU = 1
    GPU = 2


class StatusCode(enum.IntEnum):
    """Result of a transfer, as reported by :meth:`TransferStatus.Code`."""

    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7


class PollCqMode(enum.IntEnum):
    """How an RDMA backend waits for completions."""

    POLLING = 0
    EVENT = 1


@dataclass
class IOEngineConfig:
    """Where an engine's control plane listens. ``port=0`` binds a free port; the bound port is in
    :meth:`IOEngine.get_engine_desc`. ``auth_token`` (default ``MORI_IO_AUTH_TOKEN``) is the
    shared secret peers must present."""

    host: str = "127.0.0.1"
    port: int = 0
    auth_token: str | None = None


@dataclass
class RdmaBackendConfig:
    """RDMA backend settings (UCX underneath; docs/io.md says what each field means there).

    ``qp_per_transfer``: endpoints (lanes) per peer and worker, 1..64; ``post_batch_size``:
    operations posted between two progress calls (-1: a whole transfer); ``num_worker_threads``:
    UCX workers, each with a progress thread, 1..64; ``poll_cq_mode``: spin while transfers are
    outstanding (``POLLING``) or sleep on the worker's event fd (``EVENT``);
    ``enable_notification``: send the target a completion record per transfer.
    """

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = 1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True


@dataclass
class XgmiBackendConfig:
    """Intra-node GPU (NVLink) backend settings: copy streams and events in its pools."""

    num_streams: int = 64
    num_events: int = 64


@dataclass
class TcpBackendConfig:
    """TCP backend settings.

    ``num_connections``: data connections per peer (large transfers and batches are striped over
    them; each costs a sender and a receiver thread here and a thread at the target, so the
    default is half the CPUs, 1 to 4 — on a 2-CPU host one connection moves batches fastest);
    ``stripe_bytes``: a single transfer above this size is split into pieces of this size;
    ``enable_notification``: send the target a completion record per transfer.
    """

    num_connections: int = field(default_factory=lambda: max(1, min(4, (os.cpu_count() or 2) // 2)))
    stripe_bytes: int = 1 << 20
    enable_notification: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.num_connections, int) or not 1 <= self.num_connections <= 64:
            raise ValueError(f"TcpBackendConfig.num_connections={self.num_connections!r}: expected 1..64")
        if not isinstance(self.stripe_bytes, int) or self.stripe_bytes < 4096:
            raise ValueError(f"TcpBackendConfig.stripe_bytes={self.stripe_bytes!r}: expected an int >= 4096")


def _unpack_fields(cls_name: str, data: bytes, expected: set[str]) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{cls_name}.unpack expects bytes, got {type(data).__name__}")
    try:
        fields = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as err:
        raise ValueError(f"{cls_name}.unpack: not a packed {cls_name} ({err})") from None
    if not isinstance(fields, dict) or set(fields) != expected:
        raise ValueError(f"{cls_name}.unpack: not a packed {cls_name} (fields {sorted(expected)} expected)")
    return fields


@dataclass(frozen=True)
class EngineDesc:
    """What a peer needs to reach an engine: its key and control-plane address."""

    key: str
    host: str
    port: int
    hostname: str = ""
    pid: int = 0

    def pack(self) -> bytes:
        """Serializes the descriptor (msgpack) for sending to a peer."""
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, data: bytes) -> EngineDesc:
        """Rebuilds a descriptor made by :meth:`pack`; raises ``ValueError`` on anything else."""
        f = _unpack_fields("EngineDesc", data, {"key", "host", "port", "hostname", "pid"})
        return cls(str(f["key"]), str(f["host"]), int(f["port"]), str(f["hostname"]), int(f["pid"]))


@dataclass(frozen=True)
class MemoryDesc:
    """A registered memory region: owner engine, id unique within it, address, size and location.

    ``extra`` carries backend data (e.g. an IPC handle for the NVLink backend), keyed by backend.
    """

    engine_key: str
    id: int
    data: int
    size: int
    device_id: int = -1
    loc: MemoryLocationType = MemoryLocationType.CPU
    hostname: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def pack(self) -> bytes:
        """Serializes the descriptor (msgpack) for sending to a peer."""
        d = asdict(self)
        d["loc"] = int(self.loc)
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> MemoryDesc:
        """Rebuilds a descriptor made by :meth:`pack`; raises ``ValueError`` on anything else."""
        keys = {"engine_key", "id", "data", "size", "device_id", "loc", "hostname", "extra"}
        f = _unpack_fields("MemoryDesc", data, keys)
        return cls(str(f["engine_key"]), int(f["id"]), int(f["data"]), int(f["size"]), int(f["device_id"]),
                   MemoryLocationType(f["loc"]), str(f["hostname"]), dict(f["extra"]))


class Completion(Protocol):
    """What a backend attaches to a :class:`TransferStatus` to report a transfer's outcome."""

    def code(self) -> int: ...

    def message(self) -> str: ...

    def wait(self, timeout: float) -> bool: ...


class TransferStatus:
    """The state of one transfer (MORI's method names). ``Wait`` blocks until it finishes;
    ``WaitFor(timeout)`` returns ``False`` if it has not finished by then."""

    __slots__ = ("_code", "_message", "_completion", "_cond")

    def __init__(self, code: StatusCode = StatusCode.INIT, message: str = "") -> None:
        self._code = code
        self._message = message
        self._completion: Completion | None = None
        self._cond = threading.Condition()

    # -- backend side -------------------------------------------------------------------------
    def _set(self, code: StatusCode, message: str = "") -> None:
        """Finishes (or updates) the status from Python; wakes waiters."""
        with self._cond:
            self._code = StatusCode(code)
            self._message = message
            self._completion = None
            self._cond.notify_all()

    def _attach(self, completion: Completion) -> None:
        """Hands the status to a native completion object that reports its outcome."""
        with self._cond:
            self._completion = completion
            self._code = StatusCode.IN_PROGRESS
            self._cond.notify_all()

    # -- user side ------------------------------------------------------------------------------
    def Code(self) -> StatusCode:  # noqa: N802 (MORI's name)
        """The status code (``IN_PROGRESS`` until the transfer ends)."""
        c = self._completion
        if c is not None:
            return StatusCode(c.code())
        return self._code

    def Message(self) -> str:  # noqa: N802
        """Why the transfer failed (empty on success)."""
        c = self._completion
        return c.message() if c is not None else self._message

    def InProgress(self) -> bool:  # noqa: N802
        """True while the transfer is running (or not yet started)."""
        return self.Code() in (StatusCode.IN_PROGRESS, StatusCode.INIT)

    def Succeeded(self) -> bool:  # noqa: N802
        """True when the transfer finished successfully."""
        return self.Code() == StatusCode.SUCCESS

    def Failed(self) -> bool:  # noqa: N802
        """True when the transfer finished with an error."""
        return not self.InProgress() and not self.Succeeded()

    def WaitFor(self, timeout: float) -> bool:  # noqa: N802
        """Waits up to ``timeout`` seconds (GIL released); True when the transfer has finished."""
        deadline = time.monotonic() + timeout
        while True:
            c = self._completion
            left = deadline - time.monotonic()
            if c is not None:
                if c.wait(max(left, 0.0)):
                    return True
                if self._completion is c:
                    return False
                continue
            with self._cond:
                if not self.InProgress():
                    return True
                if left <= 0:
                    return False
                if self._completion is None:
                    self._cond.wait(min(left, 0.05))

    def Wait(self) -> None:  # noqa: N802
        """Blocks until the transfer finishes. Backends fail transfers after ``MORI_IO_TIMEOUT``, so
        this returns in bounded time."""
        while not self.WaitFor(3600.0):
            pass

    def __repr__(self) -> str:
        msg = self.Message()
        return f"TransferStatus({self.Code().name}{', ' + repr(msg) if msg else ''})"
