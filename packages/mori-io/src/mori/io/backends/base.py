"""The interface every mori-io backend implements, and what the engine gives it.

A backend moves bytes for one medium (TCP, NVLink, RDMA). The engine owns registration and
routing; it tells each backend about local memory and remote engines, asks ``can_serve`` which
backend can carry a (local memory, remote memory) pair, and hands it :class:`TransferRequest`s.
``submit`` returns the transfer's :class:`~mori.io.backends.Completion` (a native transfer, an
:class:`~mori.io.backends.Outcome` for one refused or already done, a
:class:`~mori.io.backends.Deferred` that a thread of the backend settles later), which the engine
attaches to the transfer's status once. A backend never raises for a failed transfer: its
completion ends with an error code (``ERR_INVALID_ARGS``/``ERR_NOT_FOUND`` for a rejected request,
``ERR_BAD_STATE`` for a broken peer, ``ERR_GPU_OP`` for a CUDA error). ``healthy(peer)`` going
False makes the router fail over.

Backends reach the engine only through :class:`BackendContext` (and this module): a control
handler refuses a request by raising :class:`ControlError` with a status code.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mori.core.batch import Batch
from mori.core.codes import TransferOp
from mori.core.inbound import InboundRecords

from .._completion import Completion, Deferred, Outcome
from .._control import ControlError
from .._limits import Limits
from ..types import BackendType, EngineDesc, MemoryDesc

__all__ = [
    "TransferOp",
    "TransferRequest",
    "BackendContext",
    "Backend",
    "Completion",
    "ControlError",
    "ControlHandler",
    "Deferred",
    "Lane",
    "Outcome",
]

# A control-plane request handler: (remote engine key, request payload) -> reply payload.
ControlHandler = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass(slots=True)
class TransferRequest:
    """One read/write or batch between ``local`` and ``remote``: ``batch`` (a
    :class:`mori.core.batch.Batch`, built once by the engine from the caller's lists or arrays)
    holds its rows (local address, remote offset, bytes), zero-byte blocks dropped and runs
    contiguous on both sides merged.

    The engine checked every row against both descriptors before a backend sees them; the target
    side checks again against what it actually registered. The completion ``submit`` returns
    reports the outcome.
    """

    op: TransferOp
    local: MemoryDesc
    remote: MemoryDesc
    batch: Batch
    uid: int
    notify: bool = True


@dataclass(frozen=True, slots=True)
class Lane:
    """What :meth:`Backend.lane` returns.

    ``start(op, local_address, remote_offset, size, uid)`` starts one block exactly as
    :meth:`Backend.submit` would start a request with that one row (notification included) and
    returns its completion, or None, with nothing started, once the connection it uses has failed
    or closed; the engine calls it only with a block it checked against both descriptors. It
    never raises. After a None the engine drops the lane and returns to :meth:`Backend.submit`
    (which may reconnect, and then give a new lane) and the router (which may fail over).

    ``drained``: the backend's :meth:`Backend.deregister_memory` itself waits for the transfers
    ``start`` began on the region (failing those past ``MORI_IO_TIMEOUT``), so the engine keeps
    no in-flight record of its own for them; a region deregistered while such a transfer starts
    fails it with ``ERR_INVALID_ARGS`` naming the region instead of ``ERR_NOT_FOUND``.

    ``finished``: the one completion ``start`` returns for every block that finished successfully
    as it started (the RDMA backend's same-host copies), told by identity: the engine reads no code
    from it. None when ``start`` has no such completion.
    """

    start: Callable[[TransferOp, int, int, int, int], Completion | None]
    drained: bool = False
    finished: Completion | None = None


class BackendContext(abc.ABC):
    """The engine services a backend may use."""

    engine_key: str
    host: str  # address the engine listens on (data planes bind here too)
    limits: Limits  # what peers may consume (connections, hello time, completion records)
    # The engine's one table of completion records (IOEngine.pop_inbound_transfer_status reads
    # it): a data plane that orders a record after the bytes writes into it in-band (hand it to
    # the native TCP target or UCX engine; a Python backend calls its ``record``).
    inbound: InboundRecords
    hostname: str
    log: logging.Logger

    @abc.abstractmethod
    def engine_desc(self) -> EngineDesc:
        """This engine's descriptor (what peers need to reach it)."""

    @abc.abstractmethod
    def io_timeout(self) -> float:
        """Seconds before an unanswered transfer fails (``MORI_IO_TIMEOUT``)."""

    @abc.abstractmethod
    def auth_token(self) -> str:
        """The shared secret this engine presents and expects ('' when none)."""

    @abc.abstractmethod
    def remote_engine(self, key: str) -> EngineDesc:
        """The registered remote engine ``key``; raises ``KeyError`` when not registered."""

    @abc.abstractmethod
    def control_request(self, remote_key: str, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Sends one control-plane request to a registered remote engine and returns its reply.

        Raises ``ConnectionError`` (peer unreachable, rejected token) or ``TimeoutError``.
        """

    @abc.abstractmethod
    def control_request_to(self, engine: EngineDesc, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """The same for an engine that need not be registered here, over a connection of its own.

        Raises ``ConnectionError``, ``TimeoutError`` or ``OSError``.
        """

    @abc.abstractmethod
    def add_control_handler(self, op: str, handler: ControlHandler) -> None:
        """Serves control-plane requests named ``op`` (e.g. ``"nvlink.open"``) with ``handler``.

        Any authenticated engine reaches a handler, registered here or not (as in MORI): the
        handler checks the request against this engine's registered memory.
        """

    @abc.abstractmethod
    def send_completions(self, remote_key: str, records: Sequence[tuple[int, int, str]]) -> None:
        """Tells the registered remote engine ``remote_key`` that transfers from this engine into
        it finished: ``records`` are (uid, final ``StatusCode``, message), which it records for
        :meth:`IOEngine.pop_inbound_transfer_status`. Sent over the control plane (its ``notify``
        op, in as few requests as its batch bound allows) after the caller's bytes have landed;
        a backend whose data plane orders the record after the bytes records in-band instead
        (into :attr:`inbound`).
        Never raises: records that cannot be delivered are logged, and the target finds none."""


class Backend(abc.ABC):
    """One transfer medium. Subclasses set ``kind`` and implement the abstract methods."""

    kind: BackendType = BackendType.Unknown
    # Higher wins when several backends can serve a pair (NVLink beats TCP for GPU memory).
    priority: int = 0

    def __init__(self, ctx: BackendContext, config: Any) -> None:
        self.ctx = ctx
        self.config = config

    @abc.abstractmethod
    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        """Whether this backend can move bytes between these two regions."""

    def healthy(self, remote_key: str) -> bool:
        """False after a failure that makes this backend unusable towards ``remote_key``; the
        router then sends later transfers to another backend that can serve."""
        return True

    @abc.abstractmethod
    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        """Makes a local region reachable; returns ``desc`` with backend data in ``extra``."""

    @abc.abstractmethod
    def deregister_memory(self, desc: MemoryDesc) -> None:
        """After this returns no remote request touches the region."""

    @abc.abstractmethod
    def register_remote_engine(self, desc: EngineDesc) -> None:
        """This engine may now start transfers to ``desc.key``."""

    @abc.abstractmethod
    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        """Drops this backend's connections, mappings and leases with ``desc.key``."""

    def describe(self) -> dict[str, Any]:
        """What the backend uses, for :meth:`mori.io.IOEngine.describe` (its transports, how GPU
        memory travels...); empty by default."""
        return {}

    @abc.abstractmethod
    def submit(self, request: TransferRequest) -> Completion:
        """Starts the transfer asynchronously and returns its completion, which ends when the
        transfer does. A transfer refused in this call (the RDMA backend's "SQ full", rows its
        transport cannot move) comes back failed already: the caller sees that at once, as in
        MORI, and the engine gives it no place in its completion order."""

    def lane(self, local: MemoryDesc, remote: MemoryDesc) -> Lane | None:
        """A short way to start single blocks between ``local`` and ``remote`` while the
        backend's connection to their engine stays up, or None (the default) when there is none
        now. The engine keeps it for as long as nothing is registered, removed or created (see
        :class:`Lane`), and otherwise uses :meth:`submit`."""
        return None

    def abort(self, remote_key: str) -> None:  # noqa: B027 (an optional hook: by default nothing to do)
        """Fails this backend's transfers to ``remote_key`` that are still running, and returns once
        none of them touches memory any more (``deregister_memory`` calls it for transfers that
        outlived ``MORI_IO_TIMEOUT``). The default does nothing: transfers that always end in
        bounded time need no more."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stops threads and connections; idempotent."""
