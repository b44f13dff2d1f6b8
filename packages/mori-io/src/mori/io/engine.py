"""The public engine: :class:`IOEngine` and :class:`IOEngineSession` (MORI's API).

The engine owns its control-plane server, its registries and its backends; transfers are checked
against the descriptors (so obvious errors fail fast without touching the network), routed to a
backend and run asynchronously; the target checks every request again against what it really
registered. The class is thin: its parts live in private modules (``_transfers`` the transfers,
``_router`` the backends, ``_clients`` the control connections, ``_regions`` what registration
checks, ``_order`` the completion order and ``wait_all``, ``_session`` the session, ``_context``
what backends see).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from mori.core import config as mori_config
from mori.core.inbound import InboundRecords
from mori.core.log import get_logger

from ._clients import ControlClients
from ._context import EngineContext, engine_handlers, node_id
from ._control import ControlServer
from ._keys import Identity
from ._limits import Limits
from ._order import PeerOrder, wait_all
from ._regions import checked_region, device_bus_id, merge_extra, tensor_region
from ._registry import (
    InFlight,
    MemoryRegistry,
    RemoteEngines,
    UidAllocator,
)
from ._router import Router
from ._session import IOEngineSession
from ._transfers import Transfers
from .backends import TransferOp, backend_factory
from .types import (
    BackendType,
    EngineDesc,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TransferStatus,
)

__all__ = ["IOEngine", "IOEngineSession"]

_log = get_logger("io")


def _shutdown(backends: Router, server: ControlServer, clients: ControlClients) -> None:
    backends.close()
    clients.close()
    server.close()


class IOEngine:
    """A transfer engine named ``key`` whose control plane listens on ``config.host:config.port``."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(key, str) or not key or len(key) > 4096:
            raise ValueError(f"IOEngine key must be a non-empty str of at most 4096 chars, got {key!r}")
        if not isinstance(config, IOEngineConfig):
            raise TypeError(f"config must be an IOEngineConfig, got {type(config).__name__}")
        self._key = key
        token = config.auth_token if config.auth_token is not None else mori_config.get("MORI_IO_AUTH_TOKEN")
        self._token = token or ""
        self._memory = MemoryRegistry()
        self._remotes = RemoteEngines()
        self._limits = Limits.from_config()
        # The one table of completion records every channel writes (control plane, native TCP and UCX).
        self._inbound = InboundRecords(
            self._limits.max_inbound,
            self._limits.inbound_ttl,
            "MORI_IO_MAX_INBOUND_RECORDS, MORI_IO_INBOUND_RECORD_TTL",
        )
        self._inflight = InFlight()
        self._uids = UidAllocator()
        self._backends = Router()
        self._lock = threading.RLock()
        self._identity = Identity(key)  # proves this engine's key to its peers (_keys)
        self._server = ControlServer(
            config.host, config.port, self._token, self._limits, log=_log, identity=self._identity
        )
        # Handlers close over the registries, not the engine, so the engine can be collected.
        self._server.handlers.update(engine_handlers(self._identity, self._memory, self._inbound))
        self._desc = EngineDesc(key, config.host, self._server.port, socket.gethostname(), os.getpid(), node_id())
        self._clients = ControlClients(self._identity, self._token, self._remotes, (config.host, self._server.port))
        self._ctx = EngineContext(
            self._desc, self._limits, self._inbound, self._remotes, self._clients, self._server, self._token
        )
        self._order = PeerOrder()  # TransferStatus's order per remote engine
        self._transfers = Transfers(key, self._memory, self._remotes, self._backends, self._order, self._inflight)
        self._finalizer = weakref.finalize(self, _shutdown, self._backends, self._server, self._clients)
        _log.info("engine %r: control plane on %s:%d", key, config.host, self._server.port)

    # ---- engines and backends ------------------------------------------------------------------
    @property
    def key(self) -> str:
        """This engine's key."""
        return self._key

    def get_engine_desc(self) -> EngineDesc:
        """The descriptor peers register with :meth:`register_remote_engine`."""
        return self._desc

    def describe(self) -> dict[str, Any]:
        """What this engine is and uses: its key, control-plane address, and each backend's own
        description by name (its transports, how GPU memory travels on it)."""
        return {
            "key": self._key,
            "host": self._desc.host,
            "port": self._desc.port,
            "backends": {b.kind.name: b.describe() for b in self._backends},
        }

    def create_backend(self, type: BackendType, config: Any = None) -> None:  # noqa: A002 (MORI's name)
        """Creates the backend of ``type`` (TCP, XGMI/NVLINK, RDMA on UCX) with its config (None: defaults)."""
        if not isinstance(type, BackendType):
            raise TypeError(f"backend type must be a BackendType, got {type!r}")
        with self._lock:
            if type in self._backends:  # as MORI: the first one stays
                _log.warning("engine %r already has a %s backend; create_backend ignored", self._key, type.name)
                return
            backend = backend_factory(type)(self._ctx, config)
            for mem in self._memory.all():
                self._memory.add(merge_extra(mem, backend.register_memory(mem)))
            for desc in self._remotes.all():
                backend.register_remote_engine(desc)
            self._backends.add(type, backend)

    def remove_backend(self, type: BackendType) -> None:  # noqa: A002
        """Closes and removes the backend of ``type``; raises ``KeyError`` if there is none."""
        with self._lock:
            backend = self._backends.remove(BackendType(type))
        if backend is None:
            raise KeyError(f"engine {self._key!r} has no {BackendType(type).name} backend")
        backend.close()

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        """Lets this engine start transfers to the engine of ``engine_desc``.

        Registration is the initiator's step only (as in MORI): a target serves any engine that
        presents its auth token and checks each request against its registered memory.
        """
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError(f"expected an EngineDesc, got {type(engine_desc).__name__}")
        with self._lock:
            self._remotes.add(engine_desc)
            for b in self._backends:
                b.register_remote_engine(engine_desc)

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        """Forgets a remote engine: this engine starts no more transfers to it and drops its
        connections and mappings with it. Its requests to this engine are still served (the auth
        token gates them, not registration)."""
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError(f"expected an EngineDesc, got {type(engine_desc).__name__}")
        with self._lock:
            if self._remotes.remove(engine_desc.key) is None:
                raise KeyError(f"engine {engine_desc.key!r} is not registered with engine {self._key!r}")
            for b in self._backends:
                b.deregister_remote_engine(engine_desc)
        self._order.forget(engine_desc.key)
        self._clients.drop(engine_desc.key)

    # ---- memory -----------------------------------------------------------------------------------
    def register_memory(self, ptr: int, size: int, device_id: int, mem_loc: MemoryLocationType) -> MemoryDesc:
        """Registers ``size`` bytes at address ``ptr`` (``device_id`` -1 for host memory)."""
        loc = checked_region(ptr, size, device_id, mem_loc)
        desc = MemoryDesc(self._key, self._memory.new_id(), ptr, size, device_id, loc, self._ctx.hostname)
        with self._lock:
            for b in self._backends:
                desc = merge_extra(desc, b.register_memory(desc))
            if loc == MemoryLocationType.GPU:
                desc = dataclasses.replace(desc, device_bus_id=device_bus_id(device_id))
            self._memory.add(desc)
        return desc

    def register_torch_tensor(self, tensor: Any) -> MemoryDesc:
        """Registers the storage of a contiguous torch tensor (CPU or CUDA)."""
        return self.register_memory(*tensor_region(tensor))

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        """Deregisters a region; after this returns no transfer touches it, so it may be freed.

        Remote engines' new requests on the region are refused from the start of the call; those
        already being served, and this engine's own transfers that use the region as local
        memory, are waited for up to ``MORI_IO_TIMEOUT`` (one wait for both). Any still running
        then are failed by closing the connections that carry them (a remote peer's request is
        cut; an own transfer ends with ``ERR_BAD_STATE``), and this returns once none touches the
        region. Requests on other regions, and other peers, are not held up meanwhile.
        """
        if not isinstance(mem_desc, MemoryDesc):
            raise TypeError(f"expected a MemoryDesc, got {type(mem_desc).__name__}")
        if mem_desc.engine_key != self._key:
            raise ValueError(f"memory {mem_desc.id} belongs to engine {mem_desc.engine_key!r}, not {self._key!r}")
        deadline = time.monotonic() + self._limits.io_timeout
        with self._lock:
            desc = self._memory.remove(mem_desc.id)
            if desc is None:
                raise KeyError(f"memory {mem_desc.id} is not registered with engine {self._key!r}")
            backends = list(self._backends)
        # Outside the engine's lock: the backends wait (up to MORI_IO_TIMEOUT) for remote requests
        # on the region, and meanwhile this engine's other work (connects, notifications) goes on.
        # A backend created from here on never sees the region: it is out of the registry.
        for b in backends:
            b.deregister_memory(desc)
        self._inflight.drain(desc.id, deadline, self._limits.io_timeout)

    # ---- transfers --------------------------------------------------------------------------------
    def allocate_transfer_uid(self) -> int:
        """A transfer id unique within this engine."""
        return self._uids.allocate()

    def read(
        self, local_mem: MemoryDesc, l_offset: int, remote_mem: MemoryDesc, r_offset: int, size: int, uid: int
    ) -> TransferStatus:
        """One-sided read of ``size`` bytes: remote ``r_offset`` -> local ``l_offset``."""
        transfers = self._transfers
        return transfers.single(
            TransferOp.READ, local_mem, [l_offset], remote_mem, [r_offset], [size], uid
        ) or transfers.submit(TransferOp.READ, local_mem, [l_offset], remote_mem, [r_offset], [size], uid)

    def write(
        self, local_mem: MemoryDesc, l_offset: int, remote_mem: MemoryDesc, r_offset: int, size: int, uid: int
    ) -> TransferStatus:
        """One-sided write of ``size`` bytes: local ``l_offset`` -> remote ``r_offset``."""
        transfers = self._transfers
        return transfers.single(
            TransferOp.WRITE, local_mem, [l_offset], remote_mem, [r_offset], [size], uid
        ) or transfers.submit(TransferOp.WRITE, local_mem, [l_offset], remote_mem, [r_offset], [size], uid)

    def batch_read(
        self,
        local_mem: MemoryDesc | Sequence[MemoryDesc],
        local_offsets: Sequence[Any],
        remote_mem: MemoryDesc | Sequence[MemoryDesc],
        remote_offsets: Sequence[Any],
        sizes: Sequence[Any],
        uid: int | Sequence[int],
    ) -> Any:
        """Reads ``len(sizes)`` blocks as one transfer (one status, one inbound record).

        MORI's engine-level form takes lists instead, one entry per descriptor pair:
        ``batch_read([local], [l_offs], [remote], [r_offs], [sizes], [uid])`` returns a list with one
        :class:`TransferStatus` per pair.
        """
        transfers = self._transfers
        return transfers.single(
            TransferOp.READ, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid
        ) or transfers.batch(TransferOp.READ, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)

    def batch_write(
        self,
        local_mem: MemoryDesc | Sequence[MemoryDesc],
        local_offsets: Sequence[Any],
        remote_mem: MemoryDesc | Sequence[MemoryDesc],
        remote_offsets: Sequence[Any],
        sizes: Sequence[Any],
        uid: int | Sequence[int],
    ) -> Any:
        """Writes ``len(sizes)`` blocks as one transfer; with lists of descriptors (MORI's
        engine-level form, see :meth:`batch_read`) one transfer and one status per pair."""
        transfers = self._transfers
        return transfers.single(
            TransferOp.WRITE, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid
        ) or transfers.batch(TransferOp.WRITE, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)

    @staticmethod
    def wait_all(statuses: Sequence[TransferStatus], timeout_ms: float = -1) -> StatusCode:
        """Waits for every status, MORI's way: the first error code found wins; ``IN_PROGRESS`` when
        ``timeout_ms`` (< 0: no limit, 0: only look) ran out first; ``SUCCESS`` for an empty list."""
        return wait_all(statuses, timeout_ms)

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        """A reusable session between two regions, or None when no backend can serve them."""
        if self._transfers.reject(local_mem, remote_mem) is not None:
            return None
        backend = self._backends.choose(local_mem, remote_mem)
        return (
            None
            if backend is None
            else IOEngineSession(
                self.allocate_transfer_uid, self._backends, self._transfers, local_mem, remote_mem, backend
            )
        )

    def pop_inbound_transfer_status(self, remote_key: str, transfer_uid: int) -> TransferStatus | None:
        """The outcome of transfer ``transfer_uid`` that engine ``remote_key`` ran into this engine,
        removed on return; None while no record has arrived."""
        record = self._inbound.pop(remote_key, transfer_uid)
        return None if record is None else TransferStatus(StatusCode(record[0]), record[1])

    # ---- control plane ------------------------------------------------------------------------------
    def lookup_remote_memory(self, remote_key: str, mem_id: int) -> MemoryDesc:
        """Fetches the descriptor of memory ``mem_id`` from a registered remote engine."""
        reply = self._clients.request(remote_key, "lookup_mem", {"id": int(mem_id)})
        return MemoryDesc.unpack(reply["desc"])

    def close(self) -> None:
        """Stops the backends and the control plane (also done when the engine is collected)."""
        self._finalizer()

    def __enter__(self) -> IOEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
