"""Public value types of mori-io: enums, configurations, descriptors and :class:`TransferStatus`.

Names and values follow MORI's Python API (``BackendType.XGMI``, ``StatusCode.ERR_NOT_FOUND`` = 12,
``TransferStatus.Succeeded()``, ``RdmaBackendConfig`` with MORI's defaults...) so code written for
MORI runs with at most an import change, except where it touches ``MemoryDesc.ipc_handle`` (MORI's
HIP IPC handle; the NVLink backend's export is in ``MemoryDesc.extra``) or MORI's fabric backend
(``BackendType.FABRIC``, ``FabricBackendConfig``), which mori-io does not have.
"""

from __future__ import annotations

import enum
import os
import reprlib
import threading
import time
from dataclasses import InitVar, asdict, dataclass, field
from typing import Any

import msgpack

from mori.core.codes import TransferCode

from ._completion import Completion

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

    Unknown = 0  #: no backend
    XGMI = 1  #: GPUs of one host (MORI's name; NVLink here)
    NVLINK = 1  #: the same member as ``XGMI``
    RDMA = 2  #: RDMA NICs, on UCX
    TCP = 3  #: any host, host memory (GPU memory staged through pinned buffers)


class MemoryLocationType(enum.IntEnum):
    """Where registered memory lives."""

    Unknown = 0  #: not a valid location for registration
    CPU = 1  #: host memory (register it with ``device_id=-1``)
    GPU = 2  #: CUDA device memory


class StatusCode(enum.IntEnum):
    """Result of a transfer, as reported by :meth:`TransferStatus.Code`: MORI's names and integer
    values (``SUCCESS=0 INIT=1 IN_PROGRESS=2``, errors 11 ... 15), which are
    :class:`mori.core.codes.TransferCode`'s."""

    SUCCESS = int(TransferCode.SUCCESS)  #: the transfer finished and every byte moved
    INIT = int(TransferCode.NOT_STARTED)  #: not submitted yet
    IN_PROGRESS = int(TransferCode.IN_PROGRESS)  #: running (or, from ``WaitFor``, the wait timed out)
    ERR_INVALID_ARGS = int(TransferCode.ERR_INVALID_ARGS)  #: an offset or size outside a region, or a bad argument
    ERR_NOT_FOUND = int(
        TransferCode.ERR_NOT_FOUND
    )  #: memory not registered (here or at the target), or engine unknown here
    ERR_RDMA_OP = int(TransferCode.ERR_TRANSPORT)  #: the RDMA backend (UCX) reported an error
    ERR_BAD_STATE = int(TransferCode.ERR_BAD_STATE)  #: peer unreachable or lost, timeout, token refused, no backend
    ERR_GPU_OP = int(TransferCode.ERR_DEVICE)  #: a CUDA operation failed


class PollCqMode(enum.IntEnum):
    """How an RDMA backend waits for completions."""

    POLLING = 0  #: spin while transfers are outstanding
    EVENT = 1  #: sleep on the worker's event file descriptor


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
    """RDMA backend settings (UCX underneath; docs/io.md says what each field means there), with
    MORI's fields in MORI's positional order (vLLM and SGLang build it positionally).

    ``qp_per_transfer``: endpoints (lanes) per peer and worker, 1..64; ``post_batch_size``:
    operations posted between two progress calls (-1: a whole transfer); ``num_worker_threads``:
    UCX workers, each with a progress thread, 1..64, taken by transfers in turn, or -1 (MORI's
    default, "auto"): two workers on a machine of 8 cores or more (else one), every transfer
    starting on the first; either way a transfer of 512 KiB or more is spread over the workers
    (each a thread of its own at both ends); ``poll_cq_mode``: spin while transfers are
    outstanding (``POLLING``) or sleep on the worker's event fd (``EVENT``);
    ``enable_notification``: send the target a completion record per transfer; ``max_send_wr``:
    operations in flight per lane and peer (0: MORI's 8192), beyond which a transfer waits and then
    fails with "SQ full" as in MORI. The other fields (``notif_per_qp`` ... ``max_msg_sge``) tune
    MORI's own verbs code; they are accepted and kept so that code setting them runs, and UCX does
    not use them.
    """

    qp_per_transfer: int = 1
    post_batch_size: int = -1
    num_worker_threads: int = -1
    poll_cq_mode: PollCqMode = PollCqMode.POLLING
    enable_notification: bool = True
    notif_per_qp: int = 1024
    enable_transfer_chunking: bool = False
    chunk_bytes: int = 65536
    max_chunks_per_transfer: int = 64
    num_nics_per_transfer: int = 1
    max_send_wr: int = 0
    max_cqe_num: int = 0
    max_msg_sge: int = 0


@dataclass
class XgmiBackendConfig:
    """Intra-node GPU (NVLink) backend settings: copy streams and events in its pools."""

    num_streams: int = 64
    num_events: int = 64


def _default_connections() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


@dataclass
class TcpBackendConfig:
    """TCP backend settings.

    ``num_connections``: data connections per peer (large transfers and batches are striped over
    them; each costs a sender and a receiver thread here and a thread at the target). ``None``
    (the default) means half the CPUs, 1 to 4: on a 2-CPU host one connection moves batches
    fastest. ``stripe_bytes``: a single transfer above this size is split into pieces of this
    size; ``enable_notification``: send the target a completion record per transfer.

    MORI's TCP backend names two of these differently; they are accepted as keywords:
    ``num_data_conns`` (= ``num_connections``) and ``striping_threshold_bytes``
    (= ``stripe_bytes``). Its socket-buffer, keep-alive and per-operation-timeout settings have
    no counterpart here (the timeout is ``MORI_IO_TIMEOUT``) and are refused.
    """

    num_connections: int | None = None
    stripe_bytes: int = 1 << 20
    enable_notification: bool = True
    num_data_conns: InitVar[int | None] = None
    striping_threshold_bytes: InitVar[int | None] = None

    def __post_init__(self, num_data_conns: int | None, striping_threshold_bytes: int | None) -> None:
        if num_data_conns is not None:
            self.num_connections = num_data_conns
        if striping_threshold_bytes is not None:
            self.stripe_bytes = striping_threshold_bytes
        if self.num_connections is None:
            self.num_connections = _default_connections()
        n = self.num_connections
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise ValueError(f"TcpBackendConfig.num_connections={n!r}: expected 1..64")
        if not isinstance(self.stripe_bytes, int) or isinstance(self.stripe_bytes, bool) or self.stripe_bytes < 4096:
            raise ValueError(f"TcpBackendConfig.stripe_bytes={self.stripe_bytes!r}: expected an int >= 4096")


# MORI's names read back as ours (the dataclass keeps them as init-only arguments).
TcpBackendConfig.num_data_conns = property(  # type: ignore[attr-defined]
    lambda self: self.num_connections, doc="MORI's name of :attr:`num_connections`."
)
TcpBackendConfig.striping_threshold_bytes = property(  # type: ignore[attr-defined]
    lambda self: self.stripe_bytes, doc="MORI's name of :attr:`stripe_bytes`."
)


_U64_MAX = (1 << 64) - 1  # ids, addresses and sizes travel as unsigned 64-bit integers
_I32_MAX = (1 << 31) - 1
_MAX_TEXT = 4096  # characters of any text field (an engine key has at most this many too)

# A descriptor field's rule: str (with its least length), int (with its range) or dict.
_Rule = tuple[type, int, int]
_TEXT: _Rule = (str, 0, _MAX_TEXT)
_NAME: _Rule = (str, 1, _MAX_TEXT)


def _field_problem(name: str, value: Any, rule: _Rule) -> str | None:
    """Why ``value`` breaks ``rule`` (a sentence naming the field), or None."""
    kind, lo, hi = rule
    if kind is str:
        if type(value) is not str or not lo <= len(value) <= hi:
            return f"{name} must be a str of {lo}..{hi} characters, got {reprlib.repr(value)}"
    elif kind is dict:
        if type(value) is not dict or not all(type(k) is str for k in value):
            return f"{name} must be a map with str keys, got {reprlib.repr(value)}"
    elif not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        return f"{name} must be an int in {lo}..{hi}, got {reprlib.repr(value)}"
    return None


def _unpack_fields(cls_name: str, data: bytes, rules: dict[str, _Rule]) -> dict[str, Any]:
    """The fields of a packed descriptor, each checked against its rule: ``ValueError`` naming
    the first fault for anything :meth:`pack` would not have made (``TypeError`` when ``data``
    is not bytes at all)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"{cls_name}.unpack expects bytes, got {type(data).__name__}")
    try:
        fields = msgpack.unpackb(bytes(data), raw=False, strict_map_key=True)
    except Exception as err:
        raise ValueError(f"{cls_name}.unpack: not a packed {cls_name} ({err})") from None
    if not isinstance(fields, dict) or set(fields) != set(rules):
        raise ValueError(f"{cls_name}.unpack: not a packed {cls_name} (fields {sorted(rules)} expected)")
    for name, rule in rules.items():
        problem = _field_problem(name, fields[name], rule)
        if problem is not None:
            raise ValueError(f"{cls_name}.unpack: {problem}")
    return fields


@dataclass(frozen=True)
class EngineDesc:
    """What a peer needs to reach an engine: its key and control-plane address. ``node_id`` names
    the machine (as MORI: ``MORI_NODE_ID`` if set, else the kernel's boot id, else the hostname)."""

    key: str
    host: str
    port: int
    hostname: str = ""
    pid: int = 0
    node_id: str = ""

    def pack(self) -> bytes:
        """Serializes the descriptor (msgpack) for sending to a peer."""
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, data: bytes) -> EngineDesc:
        """Rebuilds a descriptor made by :meth:`pack`; raises ``ValueError`` naming the field on
        anything else (a key of 1..4096 characters, text of at most 4096, a port in 0..65535, a
        pid in 0..2**63-1), ``TypeError`` when ``data`` is not bytes."""
        return cls(**_unpack_fields("EngineDesc", data, _ENGINE_FIELDS))


@dataclass(frozen=True)
class MemoryDesc:
    """A registered memory region: owner engine, id unique within it, address, size and location.

    ``device_bus_id`` is the PCI bus id of a GPU region's device (``""`` for host memory) and
    ``numa_node`` the NUMA node of host memory where known (-1 otherwise), as in MORI.
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
    device_bus_id: str = ""
    numa_node: int = -1

    def pack(self) -> bytes:
        """Serializes the descriptor (msgpack) for sending to a peer."""
        d = asdict(self)
        d["loc"] = int(self.loc)
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> MemoryDesc:
        """Rebuilds a descriptor made by :meth:`pack`; raises ``ValueError`` naming the field on
        anything else (id, address and size in 0..2**64-1 with address + size <= 2**64, device
        id and NUMA node in -1..2**31-1, a known location, text of at most 4096 characters,
        ``extra`` a map with str keys), ``TypeError`` when ``data`` is not bytes."""
        f = _unpack_fields("MemoryDesc", data, _MEMORY_FIELDS)
        f["loc"] = MemoryLocationType(f["loc"])
        desc = cls(**f)
        problem = desc._wire_problem()
        if problem is not None:
            raise ValueError(f"MemoryDesc.unpack: {problem}")
        return desc

    def _wire_problem(self) -> str | None:
        """Why this descriptor's id, address or size cannot travel as unsigned 64-bit integers
        (what a peer's data plane takes), or None."""
        i, data, size = self.id, self.data, self.size
        if (
            type(i) is int
            and type(data) is int
            and type(size) is int
            and 0 <= i <= _U64_MAX
            and data >= 0
            and size >= 0
            and data + size <= _U64_MAX + 1
        ):
            return None  # the common case, checked at every transfer: one expression
        for name in ("id", "data", "size"):
            problem = _field_problem(name, getattr(self, name), _MEMORY_FIELDS[name])
            if problem is not None:
                return problem
        if self.data + self.size > _U64_MAX + 1:
            return f"data + size must be at most 2**64, got {self.data:#x} + {self.size:#x}"
        return None


_ENGINE_FIELDS: dict[str, _Rule] = {
    "key": _NAME,
    "host": _TEXT,
    "port": (int, 0, 65535),
    "hostname": _TEXT,
    "pid": (int, 0, (1 << 63) - 1),
    "node_id": _TEXT,
}
_MEMORY_FIELDS: dict[str, _Rule] = {
    "engine_key": _NAME,
    "id": (int, 0, _U64_MAX),
    "data": (int, 0, _U64_MAX),
    "size": (int, 0, _U64_MAX),
    "device_id": (int, -1, _I32_MAX),
    "loc": (int, int(min(MemoryLocationType)), int(max(MemoryLocationType))),
    "hostname": _TEXT,
    "extra": (dict, 0, 0),
    "device_bus_id": _TEXT,
    "numa_node": (int, -1, _I32_MAX),
}


_PENDING = StatusCode.IN_PROGRESS
_PENDING_INT = int(_PENDING)
_NOT_STARTED = StatusCode.INIT
_MAKING_CONDITIONS = threading.Lock()  # a status makes its condition once (TransferStatus._condition)
_CODES = {int(c): c for c in StatusCode}


def _status_code(code: int) -> StatusCode:
    """``StatusCode(code)`` by a dict lookup: a status reads its completion's code several times
    per transfer, and the enum's own call costs about half a microsecond."""
    known = _CODES.get(code)
    return known if known is not None else StatusCode(code)  # ValueError for an unknown code


def _is_error(code: StatusCode) -> bool:
    return code not in (StatusCode.SUCCESS, StatusCode.INIT, StatusCode.IN_PROGRESS)


class TransferStatus:
    """The state of one transfer, with MORI's methods.

    ``Code()`` is ``INIT`` until the transfer is submitted, ``IN_PROGRESS`` while it runs, then
    ``SUCCESS`` or an error code. ``WaitFor(timeout_ms)`` waits (GIL released) and returns the code,
    which is still ``IN_PROGRESS`` when the wait timed out; ``timeout_ms < 0`` waits until the end,
    ``0`` only looks. ``Wait()`` is ``WaitFor(-1)``: backends fail a transfer after
    ``MORI_IO_TIMEOUT``, so it returns in bounded time.

    **Order.** A transfer reports that it has finished only once every transfer its engine started
    before it towards the same remote engine has finished too (on any session or backend), so the
    last status of a request stands for all of them, as vLLM's MoRIIO connector reads it. Its code
    is its own: an earlier transfer's failure shows in that transfer's status only. A transfer
    refused in the call that starts it (bad arguments, the RDMA backend's "SQ full") is failed at
    once and takes no place in that order.

    ``TransferStatus()``, ``SetCode``, ``SetMessage`` and ``Update`` let callers make statuses of
    their own, as MORI's tests do; ``Update`` leaves a status that already failed unchanged.
    """

    __slots__ = ("_code", "_message", "_completion", "_cond", "_prev")

    def __init__(self, code: StatusCode = StatusCode.INIT, message: str = "") -> None:
        self._code = code if type(code) is StatusCode else _status_code(code)
        self._message = message
        self._completion: Completion | None = None
        # Made when first needed (_condition): a transfer's status is read through its completion,
        # so most never wait on their own code, and a Condition costs about 1 us to make.
        self._cond: threading.Condition | None = None
        # The newest earlier transfer to the same remote engine that may still run (see Order).
        self._prev: TransferStatus | None = None

    # -- engine and backend side ----------------------------------------------------------------
    def _condition(self) -> threading.Condition:
        """The status's condition (made once, at its first use)."""
        cond = self._cond
        if cond is None:
            with _MAKING_CONDITIONS:
                cond = self._cond
                if cond is None:
                    cond = self._cond = threading.Condition()
        return cond

    def _set(self, code: StatusCode, message: str = "") -> None:
        """Sets code and message itself (``SetCode`` and the like); wakes waiters."""
        cond = self._condition()
        with cond:
            self._code = _status_code(code)
            self._message = message
            self._completion = None
            cond.notify_all()

    def _attach(self, completion: Completion) -> None:
        """Reports what ``completion`` (what the backend's ``submit`` returned) reports; the
        engine attaches it once."""
        self._completion = completion
        self._code = StatusCode.IN_PROGRESS
        # Waiters wait on the condition only while no completion is attached, and check that
        # under it: one that made it after this line looked sees the completion; one that made
        # it before is woken here.
        cond = self._cond
        if cond is not None:
            with cond:
                cond.notify_all()

    def _after(self, earlier: TransferStatus | None) -> None:
        """Reports this transfer finished only after ``earlier`` (and its predecessors) did."""
        if earlier is not None and not earlier._running():
            earlier = None if earlier._prev is None else earlier._pending_before()
        self._prev = earlier

    def _own(self) -> StatusCode:
        c = self._completion
        return _status_code(c.code()) if c is not None else self._code

    def _running(self) -> bool:
        """``_own() == IN_PROGRESS`` without making the enum (the order asks it at every transfer)."""
        c = self._completion
        return (c.code() if c is not None else self._code) == _PENDING_INT

    def _pending_before(self) -> TransferStatus | None:
        """The newest earlier transfer still running, or None; finished links are dropped."""
        p = self._prev
        while p is not None:
            if p._running():
                self._prev = p
                return p
            p = p._prev
        self._prev = None
        return None

    def _wait_own(self, deadline: float | None) -> StatusCode:
        """Waits for this transfer itself until ``deadline`` (monotonic; None: no limit)."""
        while True:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            c = self._completion
            if c is not None:
                if c.wait(max(min(left, 3600.0), 0.0)):
                    return _status_code(c.code())
                if self._completion is c and left <= 0:
                    return _PENDING
                continue
            cond = self._condition()
            with cond:
                if self._completion is not None:
                    continue
                if self._code != _PENDING:
                    return self._code
                if left <= 0:
                    return _PENDING
                cond.wait(min(left, 0.05))

    # -- user side ------------------------------------------------------------------------------
    def Code(self) -> StatusCode:  # noqa: N802 (MORI's name)
        """The status code (``IN_PROGRESS`` until the transfer, and every earlier one to the same
        engine, has ended)."""
        code = self._own()
        if code != _PENDING and self._prev is not None and self._pending_before() is not None:
            return _PENDING
        return code

    def Message(self) -> str:  # noqa: N802
        """Why the transfer failed (empty on success)."""
        c = self._completion
        return c.message() if c is not None else self._message

    def Init(self) -> bool:  # noqa: N802
        """True before the transfer is submitted."""
        return self.Code() == StatusCode.INIT

    def InProgress(self) -> bool:  # noqa: N802
        """True while the transfer runs (False before it is submitted, as in MORI)."""
        return self.Code() == _PENDING

    def Succeeded(self) -> bool:  # noqa: N802
        """True when the transfer finished successfully."""
        return self.Code() == StatusCode.SUCCESS

    def Failed(self) -> bool:  # noqa: N802
        """True when the transfer finished with an error."""
        return _is_error(self.Code())

    def SetCode(self, code: StatusCode) -> None:  # noqa: N802
        """Sets the code (waiters wake when it is no longer ``IN_PROGRESS``)."""
        with self._condition():
            message = self.Message()
            self._set(StatusCode(code), message)

    def SetMessage(self, message: str) -> None:  # noqa: N802
        """Sets the message."""
        with self._condition():
            self._set(self._own(), str(message))

    def Update(self, code: StatusCode, message: str) -> None:  # noqa: N802
        """Sets code and message, unless the status has already failed."""
        with self._condition():
            if not _is_error(self._own()):
                self._set(StatusCode(code), str(message))

    def WaitFor(self, timeout_ms: float = -1) -> StatusCode:  # noqa: N802
        """Waits up to ``timeout_ms`` milliseconds (< 0: until the end; 0: only looks) with the GIL
        released and returns ``Code()``: ``IN_PROGRESS`` if the wait timed out."""
        c = self._completion
        if self._prev is None and (type(timeout_ms) is int or type(timeout_ms) is float):
            # The common cases, a transfer that no earlier one holds back: its own code, or one
            # native wait and one code (about 1 us less per transfer than the general loop below,
            # which ends the same).
            if c is None:
                code = self._code  # kept in Python: finished (as it started, or waited for), or not started
                if code is not _PENDING and code is not _NOT_STARTED:
                    return code
            else:
                done = c.code()  # a transfer that finished as it started (one host) needs no wait
                if done != _PENDING_INT or c.wait(timeout_ms / 1000.0 if timeout_ms >= 0 else 3600.0):
                    code = _status_code(c.code() if done == _PENDING_INT else done)
                    if code is StatusCode.SUCCESS:
                        # Kept in Python from now on, the completion let go (the code first: a reader
                        # sees one or the other): the order asks every next transfer's predecessor
                        # whether it still runs, and reading the native completion costs more.
                        self._code, self._message = code, ""
                        self._completion = None
                    return code
                if timeout_ms >= 0:
                    return _PENDING
        if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float)):
            raise TypeError(f"WaitFor: timeout_ms must be a number, got {type(timeout_ms).__name__}")
        if self._own() == StatusCode.INIT:
            return StatusCode.INIT
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000.0
        if self._wait_own(deadline) == _PENDING:
            return _PENDING
        while (earlier := self._pending_before()) is not None:
            if earlier._wait_own(deadline) == _PENDING:
                return _PENDING
        return self._own()

    def Wait(self) -> None:  # noqa: N802
        """Blocks until the transfer finishes (``WaitFor(-1)``)."""
        self.WaitFor(-1)

    def __repr__(self) -> str:
        msg = self.Message()
        return f"TransferStatus({self.Code().name}{', ' + repr(msg) if msg else ''})"


_new_status = object.__new__


def _succeeded() -> TransferStatus:
    """A new status of a transfer that finished successfully as it started: what
    ``TransferStatus(StatusCode.SUCCESS)`` makes, without that constructor's check of its
    argument (a single block's short way makes one per transfer)."""
    status: TransferStatus = _new_status(TransferStatus)
    status._code = StatusCode.SUCCESS
    status._message = ""
    status._completion = None
    status._cond = None
    status._prev = None
    return status
