"""The RDMA backend, on UCX: one-sided puts and gets of registered memory (host or GPU).

UCX moves the bytes: over an InfiniBand/RoCE NIC with its verbs transports (GPUDirect RDMA for GPU
memory), or over the transports named by ``MORI_IO_RDMA_TRANSPORTS`` (``tcp``, ``sm``...) where
no NIC exists. Registration maps memory with UCX and carries the packed remote key in
``MemoryDesc.extra["rdma"]``; UCX worker addresses travel over mori's authenticated control plane
(op ``rdma.connect``), which also hands each initiator the id under which its completion
notifications (UCX active messages) are accepted. See docs/io.md for what each
:class:`RdmaBackendConfig` field means here.
"""

from __future__ import annotations

import ctypes as C
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from mori.core import config as mori_config

from ...types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
)
from .._connect import PeerConnector
from ..base import Backend, BackendContext, ControlError, TransferOp, TransferRequest
from . import _ucx as U
from ._worker import Job, PeerRoute, UcxWorker

__all__ = ["RdmaBackend", "ucx_net_devices"]

_MAX_RKEY = 64 << 10  # a packed remote key larger than this is not one
_SEND_WR_DEFAULT = 8192  # MORI's send queue depth per queue pair when max_send_wr is 0
_UNFINISHED = (StatusCode.INIT, StatusCode.IN_PROGRESS)
_MAX_INITIATORS = 1 << 16  # notification ids kept; the oldest initiator's is dropped beyond this
_MEM_TYPE = {MemoryLocationType.CPU: U.UCS_MEMORY_TYPE_HOST, MemoryLocationType.GPU: U.UCS_MEMORY_TYPE_CUDA}


def ucx_net_devices(selection: tuple[bool, tuple[str, ...]], sysfs: Path = Path("/sys/class/infiniband")) -> str:
    """``MORI_RDMA_DEVICES`` as UCX's ``NET_DEVICES``: an RDMA device name becomes each of its
    ports (``mlx5_0`` -> ``mlx5_0:1``); other names (``mlx5_0:2``, a network interface for the
    tcp transport) pass as they are; ``^`` excludes."""
    exclude, names = selection
    out: list[str] = []
    for name in names:
        ports = sorted(p.name for p in (sysfs / name / "ports").glob("*")) if ":" not in name else []
        out += [f"{name}:{p}" for p in ports] or [name]
    return ("^" if exclude else "") + ",".join(out)


def _selected(found: list[str], selection: tuple[bool, tuple[str, ...]] | None) -> list[str]:
    if selection is None:
        return found
    exclude, names = selection
    bare = {n.split(":")[0] for n in names}
    return [d for d in found if (d in bare) != exclude]


def _check_config(config: Any) -> RdmaBackendConfig:
    if config is None:
        return RdmaBackendConfig()
    if not isinstance(config, RdmaBackendConfig):
        raise TypeError(f"the RDMA backend takes an RdmaBackendConfig, got {type(config).__name__}")
    for name, auto in (("qp_per_transfer", False), ("num_worker_threads", True)):
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or not (1 <= value <= 64 or (auto and value == -1)):
            raise ValueError(f"RdmaBackendConfig.{name}={value!r}: expected an int in 1..64"
                             + (" or -1 (auto)" if auto else ""))
    if not isinstance(config.post_batch_size, int) or config.post_batch_size == 0 or config.post_batch_size < -1:
        raise ValueError(f"RdmaBackendConfig.post_batch_size={config.post_batch_size!r}: expected -1 (all) or > 0")
    if not isinstance(config.max_send_wr, int) or isinstance(config.max_send_wr, bool) or config.max_send_wr < 0:
        raise ValueError(f"RdmaBackendConfig.max_send_wr={config.max_send_wr!r}: expected 0 (MORI's 8192) or > 0")
    PollCqMode(config.poll_cq_mode)  # ValueError names a bad mode
    return config


def _worker_count(config: RdmaBackendConfig) -> int:
    """UCX workers of a checked config: -1 ("auto", MORI's default) is one, since MORI posts on the
    caller's thread, with no worker pool, for any value below 2."""
    return 1 if config.num_worker_threads == -1 else config.num_worker_threads


class _SendQueues:
    """MORI's send-queue admission: each UCX worker's endpoints to one peer hold at most
    ``depth`` operations (``max_send_wr`` per lane, as MORI's per queue pair). A transfer waits up to
    ``MORI_IO_SQ_BACKOFF_TIMEOUT_US`` for room, then fails with ``ERR_RDMA_OP`` and a message
    starting ``SQ full`` (MORI's words, which vLLM's MoRIIO connector matches to re-post). A transfer
    larger than the whole queue takes all of it. Room frees when a transfer's own outcome is final."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._cond = threading.Condition()
        self._queues: dict[tuple[int, str], list[tuple[TransferStatus, int]]] = {}

    def admit(self, worker: int, key: str, status: TransferStatus, ops: int, op: str) -> bool:
        """Reserves room for ``ops`` operations of ``status``; False after failing it with SQ full."""
        need = min(ops, self.depth)
        deadline = time.monotonic() + int(mori_config.get("MORI_IO_SQ_BACKOFF_TIMEOUT_US")) / 1e6
        with self._cond:
            queue = self._queues.setdefault((worker, key), [])
            while True:
                # Its own code, not Code(): a finished transfer frees its operations even while an
                # earlier transfer to the same engine keeps its status IN_PROGRESS. INIT is one
                # admitted and not submitted yet.
                queue[:] = [(st, n) for st, n in queue if st._own() in _UNFINISHED]
                used = sum(n for _, n in queue)
                if used + need <= self.depth:
                    queue.append((status, need))
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    status._set(StatusCode.ERR_RDMA_OP, f"SQ full ({op}): engine={key} worker={worker} depth={used} "
                                                        f"requested={need} max={self.depth}")
                    return False
                self._cond.wait(min(left, 0.001))  # finished transfers do not notify: look again soon

    def forget(self, key: str) -> None:
        """Drops the queues to engine ``key`` (its transfers have been failed or finished)."""
        with self._cond:
            for k in [k for k in self._queues if k[1] == key]:
                del self._queues[k]


def _coalesce(l_offs: Any, r_offs: Any, sizes: Any) -> list[tuple[int, int, int]]:
    """Blocks as (local, remote, size), neighbours that are contiguous on both sides merged."""
    if hasattr(sizes, "tolist"):
        l_offs, r_offs, sizes = l_offs.tolist(), r_offs.tolist(), sizes.tolist()
    out: list[tuple[int, int, int]] = []
    for lo, ro, n in zip(l_offs, r_offs, sizes):
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == ro:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
        else:
            out.append((lo, ro, n))
    return out


def _split(blocks: list[tuple[int, int, int]], lanes: int, piece: int = 1 << 20) -> list[tuple[int, int, int]]:
    """With several lanes, a transfer of fewer blocks than lanes is cut so that every lane gets a
    share (pieces of at least ``piece`` bytes)."""
    if lanes <= 1 or len(blocks) >= lanes:
        return blocks
    out = []
    for lo, ro, n in blocks:
        step = max(piece, -(-n // lanes))
        out += [(lo + at, ro + at, min(step, n - at)) for at in range(0, n, step)]
    return out


class RdmaBackend(Backend):
    """Moves registered memory with UCX one-sided operations (see the module docstring)."""

    kind = BackendType.RDMA
    priority = 50  # above TCP (10), below NVLink (100)

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        config = _check_config(config)
        super().__init__(ctx, config)
        self._ucx = U.load()
        transports = mori_config.get("MORI_IO_RDMA_TRANSPORTS")
        devices = mori_config.get("MORI_RDMA_DEVICES")
        if transports is None:
            found = self._ucx.rdma_devices()
            if not _selected(found, devices):
                why = (f"UCX ({self._ucx.where}) finds no RDMA NIC" if not found else
                       f"MORI_RDMA_DEVICES={os.environ.get('MORI_RDMA_DEVICES')!r} selects none of the "
                       f"RDMA NICs UCX finds ({', '.join(found)})")
                raise RuntimeError(
                    f"BackendType.RDMA refused: {why}. The libucx wheels from PyPI are built without verbs, so "
                    "they never find one: use a UCX built with verbs (the system's, with "
                    "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true), or allow other UCX transports with "
                    "MORI_IO_RDMA_TRANSPORTS (e.g. 'tcp,sm,self' to run the RDMA backend over TCP).")
        self._context = self._create_context(transports, devices)
        self._lock = threading.Lock()
        self._memh: dict[int, int] = {}
        self._routes: dict[str, PeerRoute] = {}
        self._issued: dict[str, int] = {}  # remote key -> the notification id we gave it
        self._accepted: dict[int, str] = {}  # notification id -> remote key
        self._unhealthy: dict[str, str] = {}
        self._closed = False
        self._send_queues = _SendQueues((config.max_send_wr or _SEND_WR_DEFAULT) * config.qp_per_transfer)
        polling = PollCqMode(config.poll_cq_mode) == PollCqMode.POLLING
        self._workers: list[UcxWorker] = []
        try:
            for i in range(_worker_count(config)):
                self._workers.append(UcxWorker(self._ucx, self._context, i, config.qp_per_transfer, polling,
                                               config.post_batch_size, f"{ctx.engine_key}:{i}", self._failed,
                                               self._inbound))
        except BaseException:
            self._destroy()
            raise
        self._connector = PeerConnector("RDMA", self._route_or_fail, self._start_routed)
        ctx.add_control_handler("rdma.connect", self._handle_connect)
        ctx.log.info("RDMA backend on %s (UCX %s, transports %s)", self._ucx.where,
                     ".".join(map(str, self._ucx.version)), ",".join(transports) if transports else "UCX's choice")

    def _create_context(self, transports: tuple[str, ...] | None, devices: Any) -> int:
        ucp, cfg = self._ucx.ucp, C.c_void_p()
        self._ucx.check("ucp_config_read", ucp.ucp_config_read(None, None, C.byref(cfg)))
        try:
            settings = []
            if transports is not None:
                settings.append(("TLS", ",".join(transports)))
            if devices is not None:
                settings.append(("NET_DEVICES", ucx_net_devices(devices)))
            for name, value in settings:
                self._ucx.check(f"setting UCX {name}={value}", ucp.ucp_config_modify(cfg, name.encode(),
                                                                                    value.encode()))
            params = U.UcpParams(field_mask=U.UCP_PARAM_FIELD_FEATURES | U.UCP_PARAM_FIELD_MT_WORKERS_SHARED
                                 | U.UCP_PARAM_FIELD_NAME,
                                 features=U.UCP_FEATURE_RMA | U.UCP_FEATURE_AM | U.UCP_FEATURE_WAKEUP,
                                 mt_workers_shared=1, name=f"mori-io:{self.ctx.engine_key}"[:31].encode())
            context = C.c_void_p()
            major, minor, _ = self._ucx.version
            status = ucp.ucp_init_version(major, min(minor, 22), C.byref(params), cfg, C.byref(context))
            if status != U.UCS_OK:
                chosen = ", ".join(f"{n}={v}" for n, v in settings) or "UCX's defaults"
                raise RuntimeError(f"BackendType.RDMA: UCX finds no usable transport or device ({chosen}: "
                                   f"{self._ucx.status_text(status)}); check MORI_IO_RDMA_TRANSPORTS and "
                                   "MORI_RDMA_DEVICES")
            return int(context.value or 0)
        finally:
            ucp.ucp_config_release(cfg)

    # ---- control plane ---------------------------------------------------------------------------
    def _handle_connect(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._closed:  # the handler outlives a removed backend
            raise ControlError(StatusCode.ERR_NOT_FOUND, f"engine {self.ctx.engine_key!r} has no RDMA backend")
        with self._lock:
            conn = self._issued.get(key)
            if conn is None:
                if len(self._issued) >= _MAX_INITIATORS:  # any engine with the token may connect: bounded
                    old_key = next(iter(self._issued))
                    self._accepted.pop(self._issued.pop(old_key), None)
                conn = self._issued[key] = secrets.randbits(63) | 1
                self._accepted[conn] = key
        return {"workers": [w.address for w in self._workers], "conn": conn}

    def _route(self, key: str) -> PeerRoute:
        route = self._routes.get(key)
        if route is not None:
            return route
        reply = self.ctx.control_request(key, "rdma.connect", {})
        workers, conn = reply.get("workers"), reply.get("conn")
        if not isinstance(workers, list) or not workers or not all(isinstance(a, bytes) for a in workers) \
                or not isinstance(conn, int):
            raise ControlError(StatusCode.ERR_BAD_STATE, f"engine {key!r} sent a malformed rdma.connect reply")
        route = PeerRoute(key, tuple(workers), conn)
        with self._lock:
            self._routes[key] = route
        return route

    def _failed(self, key: str, why: str) -> None:
        with self._lock:
            self._unhealthy[key] = why
            self._routes.pop(key, None)  # the peer may have restarted: ask for its addresses again

    def _healed(self, key: str) -> None:
        with self._lock:
            self._unhealthy.pop(key, None)

    def _inbound(self, conn: int, uid: int, code: int) -> None:
        key = self._accepted.get(conn)
        if key is not None:
            self.ctx.record_inbound(key, uid, StatusCode(code) if code in StatusCode._value2member_map_
                                    else StatusCode.ERR_BAD_STATE)

    # ---- Backend -----------------------------------------------------------------------------------
    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        extra = remote.extra.get("rdma")
        return local.id in self._memh and isinstance(extra, dict) and isinstance(extra.get("rkey"), bytes)

    def healthy(self, remote_key: str) -> bool:
        return remote_key not in self._unhealthy

    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        ucp = self._ucx.ucp
        params = U.UcpMemMapParams(field_mask=U.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | U.UCP_MEM_MAP_PARAM_FIELD_LENGTH
                                   | U.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE, address=desc.data, length=desc.size,
                                   memory_type=_MEM_TYPE[desc.loc])
        memh = C.c_void_p()
        self._ucx.check(f"registering {desc.loc.name} memory {desc.data:#x} (+{desc.size})",
                        ucp.ucp_mem_map(self._context, C.byref(params), C.byref(memh)))
        buf, size = C.c_void_p(), C.c_size_t()
        try:
            self._ucx.check("ucp_rkey_pack", ucp.ucp_rkey_pack(self._context, memh, C.byref(buf), C.byref(size)))
        except U.UcxError:
            ucp.ucp_mem_unmap(self._context, memh)
            raise
        rkey = C.string_at(buf, size.value)
        ucp.ucp_rkey_buffer_release(buf)
        with self._lock:
            self._memh[desc.id] = int(memh.value or 0)
        return MemoryDesc(desc.engine_key, desc.id, desc.data, desc.size, desc.device_id, desc.loc, desc.hostname,
                          {"rdma": {"rkey": rkey}})

    def deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            memh = self._memh.pop(desc.id, None)
        if memh is not None:
            self._ucx.ucp.ucp_mem_unmap(self._context, memh)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        pass  # endpoints are made at the first transfer

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        # As a target this engine serves any engine holding the token, registered or not (as MORI):
        # the notification id handed to desc.key stays valid.
        with self._lock:
            self._routes.pop(desc.key, None)
            self._unhealthy.pop(desc.key, None)
        for w in self._workers:
            w.forget(desc.key)
        self._send_queues.forget(desc.key)

    def _keys(self, request: TransferRequest) -> tuple[int, bytes] | None:
        """(local memory handle, remote key) of a request; None after failing it when either is missing."""
        rkey = request.remote.extra.get("rdma", {}).get("rkey")
        memh = self._memh.get(request.local.id)
        if not isinstance(rkey, bytes) or not 0 < len(rkey) <= _MAX_RKEY or memh is None:
            request.status._set(StatusCode.ERR_INVALID_ARGS, "RDMA backend: the remote memory descriptor carries "
                                "no RDMA key, or the local memory is not registered with this backend")
            return None
        return memh, rkey

    def admit(self, request: TransferRequest) -> bool:
        if self._closed:
            return True  # submit fails it
        # One operation per block (merging and cutting only change that where it matters little).
        return self._send_queues.admit(request.uid % len(self._workers), request.remote.engine_key, request.status,
                                       max(len(request.sizes), 1), request.op.name.lower())

    def submit(self, request: TransferRequest) -> None:
        keys = self._keys(request)
        if keys is None:
            return
        route = self._routes.get(request.remote.engine_key)
        if route is not None:
            self._dispatch(route, request, *keys)
        elif self._closed:
            request.status._set(StatusCode.ERR_BAD_STATE, "RDMA backend is closed")
        else:
            # Asking the peer for its addresses can take up to MORI_IO_TIMEOUT: on that peer's
            # own thread, so an unreachable peer delays no other.
            self._connector.submit(request)

    def _route_or_fail(self, key: str) -> PeerRoute:
        try:
            return self._route(key)
        except Exception as err:
            self._failed(key, str(err))
            raise

    def _start_routed(self, route: PeerRoute, request: TransferRequest) -> None:
        keys = self._keys(request)
        if keys is not None:
            self._dispatch(route, request, *keys)

    def _dispatch(self, route: PeerRoute, request: TransferRequest, memh: int, rkey: bytes) -> None:
        lanes = self.config.qp_per_transfer
        blocks = _split(_coalesce(request.local_offsets, request.remote_offsets, request.sizes), lanes)
        job = Job(request.status, request.uid, route, request.op == TransferOp.WRITE, blocks, request.local.data,
                  memh, request.remote.data, rkey, request.notify and self.config.enable_notification,
                  time.monotonic() + self.ctx.io_timeout())
        if route.key in self._unhealthy:  # a retry after a failure: success makes the backend healthy again
            job.on_success = lambda: self._healed(route.key)
        request.status._set(StatusCode.IN_PROGRESS)
        self._workers[request.uid % len(self._workers)].post(job)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._connector.closed = True  # transfers still connecting fail from now on
        self._destroy()

    def _destroy(self) -> None:
        for w in self._workers:
            w.close()
        self._workers = []
        with self._lock:
            handles = list(self._memh.values())
            self._memh.clear()
        for memh in handles:
            self._ucx.ucp.ucp_mem_unmap(self._context, memh)
        if self._context:
            self._ucx.ucp.ucp_cleanup(self._context)
            self._context = 0
