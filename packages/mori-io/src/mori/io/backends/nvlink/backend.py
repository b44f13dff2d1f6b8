"""The NVLink backend (MORI's XGMI backend): one-sided copies between GPUs of one host.

Registration exports a handle of each GPU region (``_peer_memory``) into ``MemoryDesc.extra``.
The first transfer towards a remote region asks its owner (control op ``nvlink.open``, carrying
the asking engine's descriptor: the owner need not have registered it), which checks that the
region is registered, answers with what it registered (handle, size) and remembers who opened it
and where that engine listens. The initiator maps the
region once per (engine, memory id) and from then on copies directly: large blocks with the
copy engines over a pool of streams, small blocks with one gather-kernel launch (the split is
``MORI_IO_NVLINK_KERNEL_MAX``, chosen by measurement; see ``plan``).

A transfer completes when its CUDA events fire (seen by whoever polls its status); the owner of
the remote region then gets an inbound record (``BackendContext.send_completions``), sent in batches by a
housekeeping thread that also finishes transfers nobody polls. That thread ticks every
millisecond while there is work and sleeps otherwise, and nothing on the transfer path wakes it
while it ticks: a background thread that wants the GIL while the caller submits or polls
delays the caller by a thread hand-off each time. When the owner deregisters a region, or the engine
that opened it, it revokes the mapping (``nvlink.revoke``): the initiator drops it after its
in-flight copies finish, so later transfers fail with ``ERR_NOT_FOUND`` and touch nothing.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mori.core import config as mori_config
from mori.core import cuda as _cuda
from mori.core.host import this_host

from ...types import BackendType, EngineDesc, MemoryDesc, MemoryLocationType, StatusCode, XgmiBackendConfig
from ..base import Backend, BackendContext, ControlError, TransferOp, TransferRequest
from ._peer_memory import ExportedRegion, FdServer, Mapping, export_region, fetch_fd, open_mapping
from ._queues import DeviceQueues, GpuTransfer
from .plan import plan_copies

__all__ = ["NvlinkBackend"]

# Copy-engine work of one transfer: large blocks cut into STRIPE-byte pieces over at most
# ENGINE_STREAMS streams (module attributes so the benchmark can compare settings). Measured on
# 2 H200s, one 256 MiB read: 287 GB/s as one copy, 257 (128 MiB x 2), 247 (64 MiB x 4),
# 230 (32 MiB x 8), 223 (8 MiB x 8): one copy engine per large block is best; several streams
# still serve batches of many large blocks.
STRIPE = 256 << 20
ENGINE_STREAMS = 4
# Of a batch of large rows that the gather kernel would take whole, the share of rows the copy
# engines take beside it (see plan.SHARE_MIN_ROW).
ENGINE_SHARE = 0.4

_TICK_S = 1e-3  # housekeeping period while transfers run or records wait to be sent
_NOTIFY_EVERY_S = 2e-3  # inbound records are sent at most this often (batched in between)
_IDLE_S = 0.05  # with nothing to do for this long, housekeeping sleeps until the next transfer


@dataclass
class _Opened:
    """A remote region usable here: its address in this process and its registered size."""

    mapping_key: tuple[Any, ...]
    address: int
    size: int


@dataclass
class _Flight:
    request: TransferRequest
    remote: tuple[str, int]


class NvlinkBackend(Backend):
    """Copies between GPU memory of engines on one host over NVLink (``BackendType.XGMI``/``NVLINK``)."""

    kind = BackendType.XGMI
    priority = 100

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        config = XgmiBackendConfig() if config is None else config
        if not isinstance(config, XgmiBackendConfig):
            raise TypeError(f"the XGMI/NVLink backend takes an XgmiBackendConfig, got {type(config).__name__}")
        for name in ("num_streams", "num_events"):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 4096:
                raise ValueError(f"XgmiBackendConfig.{name}={value!r}: expected an int in 1..4096")
        super().__init__(ctx, config)
        _cuda.call("cuInit", 0)
        if int(_cuda.call("cuDeviceGetCount")) == 0:
            raise RuntimeError("the XGMI/NVLink backend needs CUDA GPUs; this process sees none")
        # Engines with equal keys share GPUs and reach each other's abstract Unix sockets (fd passing).
        self._host = this_host().key
        self._kernel_max = int(mori_config.get("MORI_IO_NVLINK_KERNEL_MAX"))
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._open_lock = threading.Lock()
        self._exports: dict[int, tuple[MemoryDesc, ExportedRegion]] = {}
        self._openers: dict[int, dict[str, EngineDesc]] = {}  # memory id -> engines that mapped it
        self._mappings: dict[tuple[Any, ...], list[Any]] = {}  # key -> [Mapping, users]
        self._opened: dict[tuple[str, int], _Opened] = {}
        # Revocation generations: an open that began before a revocation of its region is void.
        self._revocations = 0
        self._revoked: dict[tuple[str, int], int] = {}
        self._queues: dict[int, DeviceQueues] = {}
        self._inflight: dict[GpuTransfer, _Flight] = {}
        self._unhealthy: set[str] = set()
        self._fd_server: FdServer | None = None
        # Inbound records to send: (target engine key, uid, code, message); appended without
        # waking anyone (deque appends are atomic).
        self._notes: deque[tuple[str, int, int, str]] = deque()
        self._stop = threading.Event()
        self._asleep = False  # housekeeping waits on _cond until a transfer or record arrives
        self._thread = threading.Thread(target=self._housekeep, name="mori-io-nvlink", daemon=True)
        self._thread.start()
        ctx.add_control_handler("nvlink.open", self._handle_open)
        ctx.add_control_handler("nvlink.revoke", self._handle_revoke)

    # ---- routing -------------------------------------------------------------------------------
    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        info = remote.extra.get("nvlink")
        return (local.loc == MemoryLocationType.GPU and remote.loc == MemoryLocationType.GPU
                and "nvlink" in local.extra and isinstance(info, dict) and info.get("host") == self._host)

    def healthy(self, remote_key: str) -> bool:
        return remote_key not in self._unhealthy

    # ---- local memory (this engine as target) --------------------------------------------------
    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        if desc.loc != MemoryLocationType.GPU:
            return desc
        exported = export_region(desc.data, desc.size, desc.device_id)
        # Work queued before registration (e.g. filling the tensor) is done before peers read it.
        _cuda.call("cuCtxSynchronize")
        with self._lock:
            self._exports[desc.id] = (desc, exported)
        return dataclasses.replace(desc, extra={"nvlink": exported.info})

    def deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            entry = self._exports.pop(desc.id, None)
            openers = self._openers.pop(desc.id, {})
        # Our own transfers that use the region locally end first.
        self._drain(lambda f: f.request.local.id == desc.id, f"memory {desc.id}")
        for key in sorted(openers):
            self._send_revoke(openers[key], [desc.id])
        if entry is not None:
            entry[1].close()

    def _handle_open(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        mem_id = body.get("id")
        if not isinstance(mem_id, int):
            raise ControlError(StatusCode.ERR_INVALID_ARGS, f"nvlink.open: memory id {mem_id!r} is not an int")
        try:
            opener = EngineDesc.unpack(body.get("engine", b""))
        except (TypeError, ValueError) as err:
            raise ControlError(StatusCode.ERR_INVALID_ARGS, f"nvlink.open: {err}") from None
        if opener.key != key:
            raise ControlError(StatusCode.ERR_INVALID_ARGS, f"nvlink.open: engine {key!r} sent the descriptor "
                                                            f"of {opener.key!r}")
        with self._lock:
            entry = self._exports.get(mem_id)
            if entry is None:
                raise ControlError(StatusCode.ERR_NOT_FOUND,
                                   f"memory {mem_id!r} is not registered with engine {self.ctx.engine_key!r}")
            self._openers.setdefault(mem_id, {})[key] = opener
            desc, exported = entry
            reply: dict[str, Any] = {"info": exported.info, "size": desc.size, "data": desc.data}
            if exported.fd >= 0:
                if self._fd_server is None:
                    self._fd_server = FdServer(self.ctx.io_timeout())
                reply.update(fd_socket=self._fd_server.address, nonce=self._fd_server.grant(exported.fd))
        return reply

    def _send_revoke(self, engine: EngineDesc, ids: list[int]) -> None:
        """Tells ``engine`` to drop its mappings of regions ``ids`` and waits until it has. A
        fresh connection: the engine may be unregistered here."""
        if not ids:
            return
        try:
            self.ctx.control_request_to(engine, "nvlink.revoke", {"ids": ids})
        except (ConnectionError, TimeoutError, OSError) as err:
            self.ctx.log.warning("nvlink: could not revoke memory %s from engine %r: %s", ids, engine.key, err)

    # ---- remote memory (this engine as initiator) ----------------------------------------------
    def _device(self, device: int) -> DeviceQueues:
        """The device's queues, with its context made current in this thread."""
        q = self._queues.get(device)
        if q is not None:
            q.make_current()
            return q
        with self._lock:
            q = self._queues.get(device)
            if q is None:
                q = self._queues[device] = DeviceQueues(device, self.config.num_streams, self.config.num_events)
        q.make_current()
        return q

    def _open(self, remote: MemoryDesc, device: int) -> _Opened:
        key = (remote.engine_key, remote.id)
        opened = self._opened.get(key)
        if opened is not None:
            return opened
        with self._open_lock:
            opened = self._opened.get(key)
            if opened is not None:
                return opened
            generation = self._revocations
            reply = self.ctx.control_request(remote.engine_key, "nvlink.open",
                                             {"id": remote.id, "engine": self.ctx.engine_desc().pack()})
            info, data, size = reply["info"], int(reply["data"]), int(reply["size"])
            if info.get("host") != self._host:
                raise ControlError(StatusCode.ERR_BAD_STATE, f"engine {remote.engine_key!r} is on another host")
            owner_base = data - int(info["offset"])
            mkey = (remote.engine_key, info["pid"], owner_base, device if info["kind"] == "vmm" else -1)
            with self._lock:
                entry = self._mappings.get(mkey)
            if entry is None:
                fd = -1
                if "nonce" in reply and info["pid"] != os.getpid():
                    fd = fetch_fd(reply["fd_socket"], reply["nonce"], self.ctx.io_timeout())
                try:
                    mapping = open_mapping(info, data, device, fd)
                finally:
                    if fd >= 0:
                        os.close(fd)
                entry = [mapping, 0]
            opened = _Opened(mkey, entry[0].base + int(info["offset"]), size)
            with self._lock:
                self._mappings[mkey] = entry
                entry[1] += 1
                if self._revoked.get(key, -1) > generation:  # revoked while we were opening it
                    self._release_mapping(mkey)
                    raise ControlError(StatusCode.ERR_NOT_FOUND, f"memory {remote.id} of engine "
                                                                 f"{remote.engine_key!r} was deregistered")
                self._opened[key] = opened
        return opened

    def _release_mapping(self, mkey: tuple[Any, ...]) -> None:
        with self._lock:
            entry = self._mappings.get(mkey)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._mappings[mkey]
        mapping: Mapping = entry[0]
        try:
            mapping.close()
        except _cuda.CudaError as err:
            self.ctx.log.warning("nvlink: closing a peer mapping failed: %s", err)

    def _forget(self, keys: list[tuple[str, int]], revoked: bool) -> None:
        """Drops the mappings of remote regions ``keys`` once no copy uses them."""
        with self._lock:
            if revoked:
                self._revocations += 1
                self._revoked.update(dict.fromkeys(keys, self._revocations))
            dropped = [self._opened.pop(k) for k in keys if k in self._opened]
        wanted = set(keys)
        self._drain(lambda f: f.remote in wanted, f"remote memory {sorted(wanted)}")
        for opened in dropped:
            self._release_mapping(opened.mapping_key)

    def _handle_revoke(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        self._forget([(key, int(i)) for i in body["ids"]], revoked=True)
        return {}

    def register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._unhealthy.discard(desc.key)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            mine = [k for k in self._opened if k[0] == desc.key]
            theirs = sorted(i for i, keys in self._openers.items() if desc.key in keys)
            for i in theirs:
                self._openers[i].pop(desc.key)
        self._forget(mine, revoked=False)
        self._send_revoke(desc, theirs)

    # ---- transfers -----------------------------------------------------------------------------
    def submit(self, request: TransferRequest) -> None:
        remote, status = request.remote, request.status
        device = request.local.device_id
        try:
            opened = self._open(remote, device)
        except ControlError as err:
            status._set(err.code, f"NVLink backend: {err}")
            return
        except (TimeoutError, OSError, ValueError, _cuda.CudaError) as err:
            code = StatusCode.ERR_GPU_OP if isinstance(err, _cuda.CudaError) else StatusCode.ERR_BAD_STATE
            with self._lock:
                self._unhealthy.add(remote.engine_key)
            status._set(code, f"NVLink backend: cannot map memory {remote.id} of engine {remote.engine_key!r}: {err}")
            return
        sizes, r_offs, l_offs = request.sizes, request.remote_offsets, request.local_offsets
        # The engine checked every block against the descriptor; the owner's registered size
        # needs its own pass only when the descriptor claims more (a forged or stale one).
        if remote.size > opened.size and len(sizes) and \
                int((np.asarray(r_offs, dtype=np.int64) + np.asarray(sizes, dtype=np.int64)).max()) > opened.size:
            status._set(StatusCode.ERR_INVALID_ARGS, f"NVLink backend: a block is out of range of remote memory "
                                                     f"{remote.id} ({opened.size} bytes registered by its owner)")
            return
        local = request.local.data
        if request.op == TransferOp.READ:
            src, dst, src_offs, dst_offs = opened.address, local, r_offs, l_offs
        else:
            src, dst, src_offs, dst_offs = local, opened.address, l_offs, r_offs
        try:
            queues = self._device(device)
            # A batch is planned straight into the pinned table the gather kernel will read.
            table = queues.kernel.tables.take(len(sizes)) if len(sizes) > 1 else None
            try:
                plan = plan_copies(src, dst, src_offs, dst_offs, sizes, self._kernel_max, STRIPE, ENGINE_STREAMS,
                                   None if table is None else table.rows, ENGINE_SHARE)
            except BaseException:
                if table is not None:
                    queues.kernel.tables.give(table)
                raise
            with self._lock:
                if self._opened.get((remote.engine_key, remote.id)) is not opened:
                    if table is not None:
                        queues.kernel.tables.give(table)
                    status._set(StatusCode.ERR_NOT_FOUND, f"NVLink backend: memory {remote.id} of engine "
                                                          f"{remote.engine_key!r} was deregistered")
                    return
                events, tables = queues.issue(plan, table)
                transfer = queues.transfer(events, tables, time.monotonic() + self.ctx.io_timeout(), self._on_done)
                if events:
                    self._inflight[transfer] = _Flight(request, (remote.engine_key, remote.id))
                    self._wake()
        except _cuda.CudaError as err:
            status._set(StatusCode.ERR_GPU_OP, f"NVLink backend: {err}")
            self._note(request, StatusCode.ERR_GPU_OP, str(err))
            return
        if events:
            status._attach(transfer)
        else:  # nothing to copy (zero bytes)
            status._set(StatusCode.SUCCESS)
            self._note(request, StatusCode.SUCCESS, "")

    def _note(self, request: TransferRequest, code: StatusCode, message: str) -> None:
        if request.notify:
            self._notes.append((request.remote.engine_key, request.uid, int(code), message))
            if self._asleep:
                with self._lock:
                    self._wake()

    def _wake(self) -> None:
        """Wakes housekeeping if it sleeps (call with ``_lock`` held); free while it ticks."""
        if self._asleep:
            self._asleep = False
            self._cond.notify()

    def _on_done(self, transfer: GpuTransfer) -> None:
        with self._lock:
            flight = self._inflight.pop(transfer, None)
        if not transfer.abandoned:  # a timed-out copy may still use them: leak rather than reuse
            transfer.queues.events.give(transfer.events)
            for table in transfer.tables:
                transfer.queues.kernel.tables.give(table)
        if flight is not None:
            self._note(flight.request, StatusCode(transfer.code()), transfer.message())

    def _drain(self, match: Callable[[_Flight], bool], what: str) -> None:
        """Finishes (bounded by MORI_IO_TIMEOUT) every in-flight transfer that matches."""
        deadline = time.monotonic() + self.ctx.io_timeout()
        while True:
            with self._lock:
                pending = [t for t, f in self._inflight.items() if match(f)]
            if not pending:
                return
            for transfer in pending:
                transfer.wait(0.0)  # ends it if its events fired (or its own deadline passed)
            if time.monotonic() > deadline:
                self.ctx.log.warning("nvlink: copies using %s still running after the timeout", what)
                return
            time.sleep(200e-6)

    def _housekeep(self) -> None:
        """Finishes transfers nobody polls (so targets get notified and resources come back) and
        sends inbound records in batches."""
        quiet_since = last_sent = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                flights = list(self._inflight)
            for transfer in flights:
                transfer.wait(0.0)
            now = time.monotonic()
            if self._notes and now - last_sent >= _NOTIFY_EVERY_S:
                self._send_notes()
                last_sent = now
            if flights or self._notes:
                quiet_since = now
            elif now - quiet_since > _IDLE_S:
                with self._cond:
                    if not self._inflight and not self._notes:
                        self._asleep = True
                        # Re-checks the queues: a record appended (lock-free) while we decided
                        # to sleep waits at most one timeout.
                        while self._asleep and not self._stop.is_set() and not self._notes and not self._inflight:
                            self._cond.wait(0.5)
                        self._asleep = False
                quiet_since = time.monotonic()
                continue
            self._stop.wait(_TICK_S)
        self._send_notes()

    def _send_notes(self) -> None:
        """Sends every queued inbound record, one batch per target engine."""
        by_key: dict[str, list[tuple[int, int, str]]] = {}
        while self._notes:
            key, uid, code, message = self._notes.popleft()
            by_key.setdefault(key, []).append((uid, code, message))
        for key, records in by_key.items():
            self.ctx.send_completions(key, records)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._drain(lambda f: True, "any memory")
        self._stop.set()
        with self._lock:
            self._wake()
        self._thread.join(timeout=self.ctx.io_timeout())
        with self._lock:
            opened, self._opened = list(self._opened.values()), {}
            exports, self._exports = [e for _, e in self._exports.values()], {}
            queues, self._queues = list(self._queues.values()), {}
            fd_server, self._fd_server = self._fd_server, None
        for o in opened:
            self._release_mapping(o.mapping_key)
        for e in exports:
            e.close()
        if fd_server is not None:
            fd_server.close()
        for q in queues:
            _cuda.init_device(q.device)
            q.close()

