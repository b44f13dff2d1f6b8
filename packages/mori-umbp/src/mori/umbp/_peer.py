"""A node's peer service (MORI's ``umbp.UMBPPeer`` over gRPC), on the node's store.

Peers allocate slots in this node's DRAM buffer, write into them with mori-io and commit them;
they resolve keys to slots under read leases of their own (SSD pages read into DRAM first), read
them with mori-io and release them. Where the store set a reserve aside for it and the gRPC C++
transport serves, resolves of keys on SSD only (and releases of their leases) are answered in
C++ without Python (``csrc/peer_ssd.h``): the same answer, the page read into a slot of the
reserve rather than staged into the DRAM tier. A leased slot's memory is not reused before the lease ends,
so a read within the lease has the value's bytes, and a release says whether the lease held; the
master sends eviction advice. What comes from the wire is checked: keys and sizes as the client checks
them, batches of at most :data:`MAX_BATCH`, and at most :data:`MAX_PENDING` uncommitted slots at
once, each aborted when its writer has not committed it within the pending TTL.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
import time
from typing import Any

import grpc

from mori.core.log import get_logger

from . import _grpc
from ._checks import check_keys
from ._enums import UMBPTierType
from ._env import runtime_int
from ._extents import ALIGN
from ._master._proto import umbp_peer_pb2 as pb
from ._master._proto import umbp_peer_pb2_grpc as pb_grpc
from ._store import LocalStore, Slot, StoreClosedError, StoreFullError

_log = get_logger("umbp")
#: Entries in one peer request.
MAX_BATCH = 4096
#: Uncommitted slots a node holds for its peers at once.
MAX_PENDING = 65536
#: The largest request the service takes.
MAX_MESSAGE_BYTES = 16 << 20
#: How long a peer's allocation may wait for room in DRAM.
ALLOCATE_TIMEOUT_S = 2.0
#: The reserve for peers' reads of SSD pages in C++, in MiB, by default.
SSD_RESERVE_MB = 16


def ssd_reserve_bytes(ssd_enabled: bool) -> int:
    """The bytes a node's store sets aside after its DRAM tier for its peers' reads of SSD pages
    in C++ (``UMBP_PEER_SSD_RESERVE_MB``; 0 turns them off): none without an SSD tier or where
    the peer service is not served by the gRPC C++ transport."""
    if not ssd_enabled or _grpc.native() is None:
        return 0
    return runtime_int("UMBP_PEER_SSD_RESERVE_MB", SSD_RESERVE_MB, 0) << 20


class _Refused(Exception):
    """A request refused whole: its gRPC status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _keys(keys: Any, what: str = "keys") -> list[str]:
    if len(keys) > MAX_BATCH:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} {what} in one request; the most is {MAX_BATCH}")
    try:
        return check_keys(keys, what)
    except (TypeError, ValueError) as exc:
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


class PeerService(pb_grpc.UMBPPeerServicer):
    """The ``UMBPPeer`` servicer over one :class:`LocalStore` (see the module's docstring).
    ``on_commit`` is called after slots were committed (the heartbeat ships them sooner)."""

    def __init__(
        self, store: LocalStore, engine_desc: bytes, buffer_desc: bytes, max_value_size: int, on_commit: Any = None
    ) -> None:
        self._store = store
        self._info = pb.GetPeerInfoResponse(
            engine_desc=engine_desc, page_size=ALIGN, buffer_desc=buffer_desc, buffer_size=store.registered_size
        )
        self._max_size = max_value_size
        self._on_commit = on_commit
        self.lease_ms = runtime_int("UMBP_DRAM_READ_LEASE_MS", 500, 1)
        self.pending_ttl_ms = runtime_int("UMBP_PENDING_SLOT_TTL_MS", 30000, 1)
        native = _grpc.native()
        #: The C++ answers to resolves of SSD-only keys (``_grpc_native.PeerSsdReads``), where
        #: the store has a reserve for them; the C++ server takes it (see :class:`PeerServer`).
        self.ssd_reads: Any = None
        if native is not None and store.reserve_bytes:
            self.ssd_reads = native.PeerSsdReads(
                store.buffer_address, store.buffer_size, store.reserve_bytes, self.lease_ms, store.ssd_checksums
            )
            store.attach_ssd_reads(self.ssd_reads)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[Slot, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="umbp-peer-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stops the reaper, aborts every pending slot and detaches the C++ SSD reads (the
        server that used them has stopped)."""
        if self.ssd_reads is not None:
            self._store.attach_ssd_reads(None)
        self._stop.set()
        self._reaper.join(5)
        with self._lock:
            pending, self._pending = self._pending, {}
        for slot, _ in pending.values():
            self._abort(slot)

    def _abort(self, slot: Slot) -> None:
        with contextlib.suppress(StoreClosedError, ValueError):  # closed, or committed meanwhile
            self._store.abort(slot)

    def _reap(self) -> None:
        while not self._stop.wait(min(1.0, self.pending_ttl_ms / 2000)):
            now = time.monotonic()
            with self._lock:
                expired = [sid for sid, (_, deadline) in self._pending.items() if deadline < now]
                slots = [self._pending.pop(sid)[0] for sid in expired]
            for slot in slots:
                _log.warning("slot of %r was not committed within %d ms: aborted", slot.key, self.pending_ttl_ms)
                self._abort(slot)

    def _serve(self, context: grpc.ServicerContext, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except _Refused as exc:
            context.abort(exc.code, str(exc))
        except StoreClosedError:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the node is closing")

    # -- the RPCs -----------------------------------------------------------------------------

    def GetPeerInfo(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._info

    def BatchAllocateSlots(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._allocate, request)

    def BatchCommitSlots(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._commit, request)

    def BatchAbortSlots(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._abort_slots, request)

    def BatchResolveKeys(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._resolve, request)

    def BatchReleaseKeys(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._release, request)

    def EvictKey(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._serve(context, self._evict, request)

    # -- what they do -------------------------------------------------------------------------

    def _allocate(self, request: Any) -> Any:
        entries = request.entries
        keys = _keys([e.key for e in entries])
        for i, e in enumerate(entries):
            if not 0 < e.size <= self._max_size:
                raise _Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"entries[{i}].size must be in [1, {self._max_size}], got {e.size}",
                )
            if e.depth < -1:
                raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"entries[{i}].depth must be >= -1, got {e.depth}")
        response = pb.BatchAllocateSlotsResponse()
        for key, e in zip(keys, entries):
            out = response.entries.add(page_size=ALIGN, pending_ttl_ms=self.pending_ttl_ms)
            if e.tier not in (UMBPTierType.Unknown, UMBPTierType.DRAM, UMBPTierType.SSD):  # SSD: via DRAM
                out.outcome = pb.ALLOCATE_SLOT_OUTCOME_FAILED
                continue
            with self._lock:
                full = len(self._pending) >= MAX_PENDING
            if full:
                out.outcome = pb.ALLOCATE_SLOT_OUTCOME_FAILED_NO_SPACE
                continue
            try:
                slot = self._store.allocate(key, e.size, e.depth, timeout=ALLOCATE_TIMEOUT_S)
            except StoreFullError:
                out.outcome = pb.ALLOCATE_SLOT_OUTCOME_FAILED_NO_SPACE
                continue
            if slot is None:
                out.outcome = pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALREADY_EXISTS
                continue
            slot_id = next(self._ids)
            with self._lock:
                self._pending[slot_id] = (slot, time.monotonic() + self.pending_ttl_ms / 1000)
            out.outcome, out.slot_id, out.offset = pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALLOCATED, slot_id, slot.offset
        return response

    def _commit(self, request: Any) -> Any:
        entries = request.entries
        keys = _keys([e.key for e in entries])
        response = pb.BatchCommitSlotsResponse()
        for key, e in zip(keys, entries):
            with self._lock:
                held = self._pending.get(e.slot_id)
                if held is not None and held[0].key == key:
                    del self._pending[e.slot_id]
                else:
                    held = None
            response.success.append(held is not None and self._store.commit(held[0]))
        if self._on_commit is not None and any(response.success):
            self._on_commit()
        return response

    def _abort_slots(self, request: Any) -> Any:
        if len(request.slot_ids) > MAX_BATCH:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT, f"{len(request.slot_ids)} slot_ids; the most is {MAX_BATCH}"
            )
        response = pb.BatchAbortSlotsResponse()
        for slot_id in request.slot_ids:
            with self._lock:
                held = self._pending.pop(slot_id, None)
            if held is not None:
                self._abort(held[0])
            response.success.append(True)
        return response

    def _resolve(self, request: Any) -> Any:
        keys = _keys(request.keys)
        response = pb.BatchResolveKeysResponse(page_size=ALIGN, lease_ms=self.lease_ms)
        for slot in self._store.resolve_many(keys, self.lease_ms / 1000):
            response.found.append(slot is not None)
            response.tier.append(int(UMBPTierType.DRAM) if slot else int(UMBPTierType.Unknown))  # type: ignore[arg-type]
            response.size.append(slot.size if slot else 0)
            response.offset.append(slot.offset if slot else 0)
            response.lease_id.append(slot.lease_id if slot else 0)
        return response

    def _release(self, request: Any) -> Any:
        keys = _keys(request.keys)
        if len(request.lease_id) != len(keys):
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(request.lease_id)} lease_ids")
        response = pb.BatchReleaseKeysResponse()
        response.held.extend(self._store.release(key, lease) for key, lease in zip(keys, request.lease_id))
        return response

    def _evict(self, request: Any) -> Any:
        """The master's advice frees each key's fastest tier: DRAM pages move to SSD."""
        keys = _keys(request.keys)
        response = pb.EvictKeyResponse()
        for key in keys:
            response.evicted.add(key=key, bytes_freed=self._store.demote(key))
        return response


class PeerServer:
    """A :class:`PeerService` served on the gRPC transport :func:`._grpc.native` picks: gRPC C++
    where built (a call handled on the thread that receives it), else grpcio. ``port`` is where it listens."""

    def __init__(self, service: PeerService, host: str, port: int, workers: int = 8) -> None:
        address = f"{host}:{port}"
        native = _grpc.native()
        self._server: grpc.Server | _grpc.NativeServer
        if native is not None:
            self._server = _grpc.NativeServer(
                native,
                address,
                [(pb_grpc.add_UMBPPeerServicer_to_server, service)],
                workers=workers,
                max_message_bytes=MAX_MESSAGE_BYTES,
                max_streams=workers * 4,
                ssd_reads=service.ssd_reads,
            )
            self.port = self._server.port
            return
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="umbp-peer"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        pb_grpc.add_UMBPPeerServicer_to_server(service, server)
        try:
            self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpcio's newer versions raise where older ones answer 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        server.start()
        self._server = server

    def stop(self, grace_s: float) -> None:
        """Calls in flight get ``grace_s`` to finish; returns once the server has stopped."""
        if isinstance(self._server, _grpc.NativeServer):
            self._server.stop(grace_s)
        else:
            self._server.stop(grace_s).wait(grace_s + 5)


def serve(service: PeerService, host: str, port: int, workers: int = 8) -> PeerServer:
    """The service on ``host:port`` (0: a free port), started; OSError when it cannot listen."""
    try:
        return PeerServer(service, host, port, workers)
    except OSError as exc:
        raise OSError(f"the peer service {exc}") from None
