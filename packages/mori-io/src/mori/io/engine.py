"""The public engine: :class:`IOEngine` and :class:`IOEngineSession` (MORI's API).

The engine owns its control-plane server, its registries and its backends; transfers are checked
here against the descriptors (so obvious errors fail fast without touching the network), routed
to a backend (``_router``) and run asynchronously; the target checks every request again against
what it really registered. The class is thin: its parts live in private modules (``_router`` the
backends, ``_clients`` the control connections, ``_regions`` what registration checks, ``_order``
the completion order and ``wait_all``, ``_session`` the session, ``_context`` what backends see).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from mori.core import config as mori_config
from mori.core.batch import Batch
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
from .backends import Backend, Outcome, TransferOp, TransferRequest, backend_factory
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


_U64_END = 1 << 64  # uids, addresses and offsets travel as unsigned 64-bit integers
# Batch's own names of its columns, as the engine's callers know them.
_COLUMNS = (("src_offsets", "local offsets"), ("dst_offsets", "remote offsets"))


def _int(name: str, value: Any) -> int:
    """``value`` as an int; bools and non-integers raise ``TypeError`` naming ``name``."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _named(err: Exception) -> str:
    """A message of :class:`Batch` in the words of the engine's caller (local/remote offsets)."""
    text = str(err).removeprefix("Batch: ")
    for column, name in _COLUMNS:
        text = text.replace(column, name)
    return text


def _batch(base: int, l_offs: Any, r_offs: Any, sizes: Any) -> Batch | str:
    """The rows (``base`` + local offset, remote offset, bytes) of a transfer, built once, or why
    its values cannot be (a negative value, one past 64 bits). ``TypeError`` for what is not
    integers, ``ValueError`` for columns of different lengths. One block of plain ints (read,
    write, most small batches) takes the short way."""
    if type(sizes) is list and type(l_offs) is list and type(r_offs) is list and len(sizes) == 1 \
            and len(l_offs) == len(r_offs) == 1:
        lo, ro, n = l_offs[0], r_offs[0], sizes[0]
        if type(lo) is int and type(ro) is int and type(n) is int and lo >= 0 and ro >= 0 and n >= 0 \
                and base + lo + n <= _U64_END and ro + n <= _U64_END:
            return Batch.one(base + lo, ro, n)
    try:
        return Batch(l_offs, r_offs, sizes, base)
    except TypeError as err:
        raise TypeError(_named(err)) from None
    except ValueError as err:  # the columns were read, so they have lengths
        if not len(l_offs) == len(r_offs) == len(sizes):
            raise ValueError(f"batch lengths differ: {len(l_offs)} local offsets, {len(r_offs)} remote offsets, "
                             f"{len(sizes)} sizes") from None
        return _named(err)


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
        self._inbound = InboundRecords(self._limits.max_inbound, self._limits.inbound_ttl,
                                       "MORI_IO_MAX_INBOUND_RECORDS, MORI_IO_INBOUND_RECORD_TTL")
        self._inflight = InFlight()
        self._uids = UidAllocator()
        self._backends = Router()
        self._lock = threading.RLock()
        self._identity = Identity(key)  # proves this engine's key to its peers (_keys)
        self._server = ControlServer(config.host, config.port, self._token, self._limits, log=_log,
                                     identity=self._identity)
        # Handlers close over the registries, not the engine, so the engine can be collected.
        self._server.handlers.update(engine_handlers(self._identity, self._memory, self._inbound))
        self._ctx = EngineContext(self, config.host, self._token)
        self._desc = EngineDesc(key, config.host, self._server.port, self._ctx.hostname, os.getpid(), node_id())
        self._clients = ControlClients(self._identity, self._token, self._remotes, (config.host, self._server.port))
        self._order = PeerOrder()  # TransferStatus's order per remote engine
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

    def _reject(self, local: MemoryDesc, remote: MemoryDesc) -> tuple[StatusCode, str] | None:
        live = self._memory.get(local.id) if local.engine_key == self._key else None
        if live is None:
            return StatusCode.ERR_NOT_FOUND, f"local memory {local.id} is not registered with engine {self._key!r}"
        if live is not local and live != local:
            return StatusCode.ERR_INVALID_ARGS, (f"local memory descriptor {local.id} does not match its registration "
                                                 f"with engine {self._key!r} (address, size or location differ: "
                                                 "stale or altered)")
        if remote.engine_key not in self._remotes:
            return StatusCode.ERR_NOT_FOUND, f"remote engine {remote.engine_key!r} is not registered"
        # Checked before a transfer is queued anywhere: a value a backend cannot encode must fail
        # the transfer, not the call that queued it.
        problem = remote._wire_problem()
        return None if problem is None else (StatusCode.ERR_INVALID_ARGS, f"remote memory descriptor: {problem}")

    def _submit(self, op: TransferOp, local: MemoryDesc, l_offs: Any, remote: MemoryDesc, r_offs: Any, sizes: Any,
                uid: int, backend: Backend | None = None) -> TransferStatus:
        if not isinstance(local, MemoryDesc) or not isinstance(remote, MemoryDesc):
            raise TypeError("local and remote memory must be MemoryDesc objects")
        batch = _batch(local.data, l_offs, r_offs, sizes)
        uid = _int("transfer uid", uid)
        problem = self._reject(local, remote)
        if problem is None and not 0 <= uid < _U64_END:
            problem = StatusCode.ERR_INVALID_ARGS, f"transfer uid {uid} outside 0..2**64-1"
        if problem is None and isinstance(batch, str):
            problem = StatusCode.ERR_INVALID_ARGS, batch
        elif problem is None and isinstance(batch, Batch) and len(batch):
            if batch.src_end - local.data > local.size:
                problem = StatusCode.ERR_INVALID_ARGS, f"a block runs past the end of local memory {local.id} " \
                                                       f"({local.size} bytes)"
            elif batch.dst_end > remote.size:
                problem = StatusCode.ERR_INVALID_ARGS, f"a block runs past the end of remote memory {remote.id} " \
                                                       f"({remote.size} bytes)"
        if problem is None and backend is None:
            backend = self._backends.choose(local, remote)
            if backend is None:
                problem = StatusCode.ERR_BAD_STATE, (f"no backend of engine {self._key!r} can move {local.loc.name} "
                                                     f"<-> {remote.loc.name} memory (created: "
                                                     f"{self._backends.names() or 'none'})")
        if problem is not None:
            return TransferStatus(*problem)
        assert backend is not None and not isinstance(batch, str)
        # IN_PROGRESS from the start: no one sees the status before the order below publishes it.
        status = TransferStatus(StatusCode.IN_PROGRESS)
        request = TransferRequest(op, local, remote, batch, uid, status)
        refusal = backend.admit(request)
        if refusal is not None:  # refused on the spot ("SQ full"): failed now, outside the order
            status._attach(refusal)
            return status
        self._order.join(remote.engine_key, status)
        # Known to deregister_memory before it starts; a deregistration that raced ahead fails it here.
        self._inflight.add(local.id, status, backend, remote.engine_key)
        if self._memory.get(local.id) is None:
            status._attach(Outcome(StatusCode.ERR_NOT_FOUND, f"local memory {local.id} was deregistered"))
            return status
        try:
            completion = backend.submit(request)
        except Exception as err:  # queued above: whatever went wrong must finish the status
            # A backend must not raise (base.py), but if one does, the transfer is already in this
            # peer's completion order: left IN_PROGRESS it would hold back every later status.
            _log.error("engine %r: %s backend raised while starting transfer %d: %r", self._key,
                       backend.kind.name, uid, err)
            completion = Outcome(StatusCode.ERR_BAD_STATE, f"the {backend.kind.name} backend failed to start the "
                                                          f"transfer: {err!r}")
        if completion is None:  # a backend breaking its contract must not wedge the order either
            completion = Outcome(StatusCode.ERR_BAD_STATE, f"the {backend.kind.name} backend returned no completion")
        status._attach(completion)
        return status

    def read(self, local_mem: MemoryDesc, l_offset: int, remote_mem: MemoryDesc, r_offset: int, size: int,
             uid: int) -> TransferStatus:
        """One-sided read of ``size`` bytes: remote ``r_offset`` -> local ``l_offset``."""
        return self._submit(TransferOp.READ, local_mem, [l_offset], remote_mem, [r_offset], [size], uid)

    def write(self, local_mem: MemoryDesc, l_offset: int, remote_mem: MemoryDesc, r_offset: int, size: int,
              uid: int) -> TransferStatus:
        """One-sided write of ``size`` bytes: local ``l_offset`` -> remote ``r_offset``."""
        return self._submit(TransferOp.WRITE, local_mem, [l_offset], remote_mem, [r_offset], [size], uid)

    def _batch(self, op: TransferOp, local_mem: Any, local_offsets: Any, remote_mem: Any, remote_offsets: Any,
               sizes: Any, uid: Any) -> Any:
        if not isinstance(local_mem, (list, tuple)):
            return self._submit(op, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)
        # MORI's engine-level form: one list entry per descriptor pair, one status each.
        columns = {"local memory": local_mem, "local offsets": local_offsets, "remote memory": remote_mem,
                   "remote offsets": remote_offsets, "sizes": sizes, "uids": uid}
        for name, column in columns.items():
            if not isinstance(column, (list, tuple)):
                raise TypeError(f"batch with a list of descriptors: {name} must be a list too, got "
                                f"{type(column).__name__}")
        if len({len(c) for c in columns.values()}) > 1:
            raise ValueError("batch with a list of descriptors: lengths differ (" +
                             ", ".join(f"{len(c)} {name}" for name, c in columns.items()) + ")")
        for lm, rm in zip(local_mem, remote_mem):
            if not isinstance(lm, MemoryDesc) or not isinstance(rm, MemoryDesc):
                raise TypeError("local and remote memory must be MemoryDesc objects")
        return [self._submit(op, *pair) for pair in zip(local_mem, local_offsets, remote_mem, remote_offsets,
                                                        sizes, uid)]

    def batch_read(self, local_mem: MemoryDesc | Sequence[MemoryDesc], local_offsets: Sequence[Any],
                   remote_mem: MemoryDesc | Sequence[MemoryDesc], remote_offsets: Sequence[Any],
                   sizes: Sequence[Any], uid: int | Sequence[int]) -> Any:
        """Reads ``len(sizes)`` blocks as one transfer (one status, one inbound record).

        MORI's engine-level form takes lists instead, one entry per descriptor pair:
        ``batch_read([local], [l_offs], [remote], [r_offs], [sizes], [uid])`` returns a list with one
        :class:`TransferStatus` per pair.
        """
        return self._batch(TransferOp.READ, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)

    def batch_write(self, local_mem: MemoryDesc | Sequence[MemoryDesc], local_offsets: Sequence[Any],
                    remote_mem: MemoryDesc | Sequence[MemoryDesc], remote_offsets: Sequence[Any],
                    sizes: Sequence[Any], uid: int | Sequence[int]) -> Any:
        """Writes ``len(sizes)`` blocks as one transfer; with lists of descriptors (MORI's
        engine-level form, see :meth:`batch_read`) one transfer and one status per pair."""
        return self._batch(TransferOp.WRITE, local_mem, local_offsets, remote_mem, remote_offsets, sizes, uid)

    @staticmethod
    def wait_all(statuses: Sequence[TransferStatus], timeout_ms: float = -1) -> StatusCode:
        """Waits for every status, MORI's way: the first error code found wins; ``IN_PROGRESS`` when
        ``timeout_ms`` (< 0: no limit, 0: only look) ran out first; ``SUCCESS`` for an empty list."""
        return wait_all(statuses, timeout_ms)

    def create_session(self, local_mem: MemoryDesc, remote_mem: MemoryDesc) -> IOEngineSession | None:
        """A reusable session between two regions, or None when no backend can serve them."""
        if self._reject(local_mem, remote_mem) is not None:
            return None
        backend = self._backends.choose(local_mem, remote_mem)
        return None if backend is None else IOEngineSession(self, local_mem, remote_mem, backend)

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

