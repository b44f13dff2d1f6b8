"""The RDMA backend, on mori-core's native UCX engine (:mod:`mori.core.ucx`).

UCX moves the bytes: over an InfiniBand/RoCE NIC with its verbs transports (GPUDirect RDMA for GPU
memory), shared memory and ``cma`` between engines of one host, or the transports named by
``MORI_IO_RDMA_TRANSPORTS`` (``tcp``, ``sm``...) where no NIC exists. The engine posts each
transfer's whole batch in one call with the GIL released and completes it into a slot that the
transfer's :class:`~mori.io.TransferStatus` reads; no Python runs per block.

Blocks travel on the engine's checked path: the target checks every access against its live
registrations before a byte of its memory moves, on every transport (UCX's tcp, sm and cma do not
enforce remote keys). No remote key travels in a descriptor: ``MemoryDesc.extra["rdma"]`` only
says that the region is registered with an RDMA backend. The target's worker addresses and the
ticket its engine admits the initiator with travel over mori's authenticated control plane (op
``rdma.connect``), so only the key that authenticated there reaches its memory. See docs/io.md for
what each :class:`RdmaBackendConfig` field means here.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

from mori.core import config as mori_config
from mori.core import ucx

from ...types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
)
from .._connect import PeerConnector
from .._gpu_staging import stager_for
from ..base import (
    Backend,
    BackendContext,
    Completion,
    ControlError,
    Lane,
    Outcome,
    TransferRequest,
)

__all__ = ["RdmaBackend", "ucx_net_devices"]

ucx_net_devices = ucx.net_devices  # mori-core's, under the name this module has always given it

_SERVED = (MemoryLocationType.CPU, MemoryLocationType.GPU)
SEND_WR_DEFAULT = 8192  # MORI's send queue depth per queue pair when max_send_wr is 0


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
            raise ValueError(
                f"RdmaBackendConfig.{name}={value!r}: expected an int in 1..64" + (" or -1 (auto)" if auto else "")
            )
    if not isinstance(config.post_batch_size, int) or config.post_batch_size == 0 or config.post_batch_size < -1:
        raise ValueError(f"RdmaBackendConfig.post_batch_size={config.post_batch_size!r}: expected -1 (all) or > 0")
    if not isinstance(config.max_send_wr, int) or isinstance(config.max_send_wr, bool) or config.max_send_wr < 0:
        raise ValueError(f"RdmaBackendConfig.max_send_wr={config.max_send_wr!r}: expected 0 (MORI's 8192) or > 0")
    PollCqMode(config.poll_cq_mode)  # ValueError names a bad mode
    return config


def _workers(config: RdmaBackendConfig) -> tuple[int, bool]:
    """UCX workers of a config, and whether transfers take them in turn: -1 ("auto", MORI's
    default) is mori-core's :func:`~mori.core.ucx.auto_workers` with every transfer starting on
    the first; N is N workers taken in turn."""
    if config.num_worker_threads != -1:
        return config.num_worker_threads, True
    return ucx.auto_workers(), False


def _settings(transports: tuple[str, ...] | None) -> list[tuple[str, str]]:
    settings = [] if transports is None else [("TLS", ",".join(transports))]
    return settings + list(ucx.selected_devices().items())


# UCX transport names that allow its one-sided copies between processes of one host (cma, part of
# UCX's "sm" and "all"): the same kind of copy as the same-host path's direct one.
_CMA_TRANSPORTS = ("all", "sm", "cma")


def _copies_directly(transports: tuple[str, ...] | None) -> bool:
    """Whether initiators copy small same-host transfers themselves (mori-core's same-host path,
    ``same_host_direct``): with UCX's choice of transports, or a list that allows cma. A list
    without it (``tcp``) keeps every transfer on a path the target's engine serves."""
    return transports is None or any(t in _CMA_TRANSPORTS for t in transports)


def _refused(err: ValueError | RuntimeError) -> Outcome:
    """The completion of a transfer the engine refused to start: a block outside the local
    registration or an offset past 2**63 (ValueError), the engine closed meanwhile (RuntimeError)."""
    code = StatusCode.ERR_INVALID_ARGS if isinstance(err, ValueError) else StatusCode.ERR_BAD_STATE
    return Outcome(code, f"RDMA backend: {err}")


class RdmaBackend(Backend):
    """Moves registered memory with mori-core's UCX engine (see the module docstring)."""

    kind = BackendType.RDMA
    priority = 50  # above TCP (10), below NVLink (100)

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        config = _check_config(config)
        super().__init__(ctx, config)
        info = ucx.load()
        transports = mori_config.get("MORI_IO_RDMA_TRANSPORTS")
        devices = mori_config.get("MORI_RDMA_DEVICES")
        if transports is None:
            found = list(info["rdma_devices"])
            if not _selected(found, devices):
                why = (
                    f"UCX ({info['path']}, {info['source']}) finds no RDMA NIC"
                    if not found
                    else f"MORI_RDMA_DEVICES={os.environ.get('MORI_RDMA_DEVICES')!r} selects none of the "
                    f"RDMA NICs UCX finds ({', '.join(found)})"
                )
                raise RuntimeError(
                    f"BackendType.RDMA refused: {why}. The libucx wheels from PyPI are built without verbs, so "
                    "they never find one: install a UCX built with verbs (Debian's libucx0, or name one with "
                    "MORI_UCX_LIB), or allow other UCX transports with MORI_IO_RDMA_TRANSPORTS (e.g. "
                    "'tcp,sm,self' to run the RDMA backend over TCP)."
                )
        settings = _settings(transports)
        workers, round_robin = _workers(config)
        try:
            self._engine = ucx.UcxEngine(
                f"mori-io:{ctx.engine_key}"[:31],
                settings,
                workers=workers,
                round_robin=round_robin,
                lanes=config.qp_per_transfer,
                polling=PollCqMode(config.poll_cq_mode) == PollCqMode.POLLING,
                timeout=ctx.io_timeout(),
                timeout_setting="MORI_IO_TIMEOUT",
                inbound=ctx.inbound,
                same_host=bool(mori_config.get("MORI_IO_RDMA_SAME_HOST")),
                same_host_direct=_copies_directly(transports),
                # MORI's send queue per queue pair, over the lanes: the engine refuses "SQ full"
                # after MORI_IO_SQ_BACKOFF_TIMEOUT_US in the call that starts a transfer.
                send_queue=(config.max_send_wr or SEND_WR_DEFAULT) * config.qp_per_transfer,
                send_queue_wait=int(mori_config.get("MORI_IO_SQ_BACKOFF_TIMEOUT_US")) / 1e6,
            )
        except (RuntimeError, ValueError) as err:
            chosen = ", ".join(f"{n}={v}" for n, v in settings) or "UCX's defaults"
            raise RuntimeError(
                f"BackendType.RDMA: UCX finds no usable transport or device ({chosen}: {err}); "
                "check MORI_IO_RDMA_TRANSPORTS and MORI_RDMA_DEVICES"
            ) from err
        # GPU memory goes to UCX directly only where a transport moves it zero-copy (verbs with
        # GPUDirect and a UCX with CUDA); otherwise the engine stages it through mori-core's
        # pinned-memory staging (one per device, shared with the TCP backend), made at the first
        # GPU registration.
        self._gpudirect = ucx.gpudirect_transports(self._engine)
        self._transports = ucx.transports(self._engine.describe())
        # Without verbs (tcp between hosts), host messages go eager (between two namespaces: one
        # 64 KiB write in 36 us against 47-50, 64 x 64 KiB at 2.8 GB/s against 2.3-2.4).
        ucx.eager_without_verbs(self._engine)
        self._stager: Any = None
        self._lock = threading.Lock()
        self._registered: set[int] = set()
        self._peers: dict[str, Any] = {}  # remote key -> ucx.UcxPeer
        self._closed = False
        self._notify = bool(config.enable_notification)
        self._connector = PeerConnector("RDMA", self._connect_peer, self._start_accepted)
        # The worker each next initiator's first worker connects to, in turn: initiators of one
        # worker each (or starting every transfer on their first) spread over this engine's workers.
        self._next_worker = itertools.count()
        ctx.add_control_handler("rdma.connect", self._handle_connect)
        ctx.log.info(
            "RDMA backend on UCX %s (%s, %s), transports %s; GPU memory %s",
            ".".join(map(str, info["version"])),
            info["path"],
            info["source"],
            ",".join(transports) if transports else "UCX's choice",
            self.gpu_memory,
        )

    @property
    def gpu_memory(self) -> str:
        """How GPU memory travels on this backend: ``"direct (GPUDirect: ...)"`` where UCX reports a
        transport that moves it zero-copy, else ``"staged (...)"`` through pinned host memory."""
        if self._gpudirect:
            return f"direct (GPUDirect: {', '.join(self._gpudirect)})"
        moving = sorted({t.split("/")[0] for t in self._transports} - {"self"})
        return f"staged through pinned host memory (no transport with GPUDirect: {', '.join(moving) or 'none'})"

    def describe(self) -> dict[str, Any]:
        # Per peer engine reached on the same-host path, how its host-memory transfers move:
        # "direct" (this process copies those of up to 64 KiB itself), or "served: <why not>".
        with self._lock:
            peers = list(self._peers.items())
        same_host = {key: p.same_host_path for key, p in peers if p.same_host}
        return {
            "transports": self._transports,
            "gpu_memory": self.gpu_memory,
            "same_host": same_host,
            "eager_bytes": self._engine.eager_bytes,
        }

    # ---- control plane ---------------------------------------------------------------------------
    def _handle_connect(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._closed:  # the handler outlives a removed backend
            raise ControlError(StatusCode.ERR_NOT_FOUND, f"engine {self.ctx.engine_key!r} has no RDMA backend")
        # The ticket admits UCX requests from the key this control session authenticated as (any
        # engine with the token may connect, as in MORI; the engine bounds the tickets it keeps).
        addresses = list(self._engine.addresses)
        return {
            "workers": addresses,
            "first": next(self._next_worker) % len(addresses),
            "ticket": int(self._engine.admit(key)),
            "same_host": self._engine.same_host_address,
            # This engine stages its GPU memory (no GPUDirect): small transfers of it may come and
            # go eager, one message instead of a rendezvous.
            "stages_gpu": not self._gpudirect,
        }

    def _connect_peer(self, request: TransferRequest) -> Any:
        """Endpoints to the request's engine, published for later transfers (on the connector's
        thread: asking the peer can take up to ``MORI_IO_TIMEOUT``)."""
        key = request.remote.engine_key
        reply = self.ctx.control_request(key, "rdma.connect", {})
        workers, ticket, same_host = reply.get("workers"), reply.get("ticket"), reply.get("same_host", b"")
        first = reply.get("first", 0)  # an engine that does not choose: its first worker
        stages_gpu = reply.get("stages_gpu", False)  # an engine that does not say: GPU memory left to UCX
        if (
            not isinstance(workers, list)
            or not workers
            or not all(isinstance(a, bytes) for a in workers)
            or not isinstance(first, int)
            or isinstance(first, bool)
            or not 0 <= first < len(workers)
            or not isinstance(ticket, int)
            or isinstance(ticket, bool)
            or not 0 < ticket < 1 << 64
            or not isinstance(same_host, bytes)
            or len(same_host) > 4096
            or not isinstance(stages_gpu, bool)
        ):
            raise ControlError(StatusCode.ERR_BAD_STATE, f"engine {key!r} sent a malformed rdma.connect reply")
        # Worker i of this engine connects to the peer's worker (first + i) mod its workers.
        peer = self._engine.connect(key, workers[first:] + workers[:first], ticket, same_host, stages_gpu=stages_gpu)
        self.ctx.log.info(
            "RDMA backend: engine %r reached over %s%s; GPU memory %s",
            key,
            ", ".join(ucx.transports(peer.describe())) or "UCX's choice",
            f" (host memory on the same-host path, {peer.same_host_path})" if peer.same_host else "",
            self.gpu_memory,
        )
        with self._lock:
            if self._closed:
                peer.close()
                raise RuntimeError("RDMA backend was closed before the transfer started")
            self._peers[key] = peer
        return peer

    # ---- Backend -----------------------------------------------------------------------------------
    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        return local.id in self._registered and remote.loc in _SERVED and isinstance(remote.extra.get("rdma"), dict)

    def healthy(self, remote_key: str) -> bool:
        peer = self._peers.get(remote_key)
        return peer is None or bool(peer.healthy())

    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        if desc.loc not in _SERVED:
            raise ValueError(f"the RDMA backend cannot register {desc.loc.name} memory")
        gpu = desc.loc == MemoryLocationType.GPU
        if gpu and not self._gpudirect:
            self._stage(desc)
        self._engine.register_memory(desc.id, desc.data, desc.size, gpu)
        with self._lock:
            self._registered.add(desc.id)
        # No key travels: the target checks every access itself (see the module docstring).
        return MemoryDesc(
            desc.engine_key, desc.id, desc.data, desc.size, desc.device_id, desc.loc, desc.hostname, {"rdma": {}}
        )

    def _stage(self, desc: MemoryDesc) -> None:
        """Makes the engine stage its GPU memory through ``desc``'s device's staging (at the first
        GPU registration); the engine stages one device's memory."""
        stager = stager_for(self.ctx, desc, "RDMA backend")
        with self._lock:
            if self._stager is None:
                ucx.stage_gpu(self._engine, stager)
                self._stager, self._stager_device = stager, desc.device_id
                self.ctx.log.info("RDMA backend: GPU memory of device %d %s", desc.device_id, self.gpu_memory)
            elif stager is not self._stager:
                raise ValueError(
                    f"RDMA backend: this engine stages GPU memory of device {self._stager_device}; "
                    f"register memory of device {desc.device_id} with an engine of its own"
                )

    def deregister_memory(self, desc: MemoryDesc) -> None:
        with self._lock:
            self._registered.discard(desc.id)
        # Refuses new accesses at once; waits (each ends within MORI_IO_TIMEOUT) for those in flight,
        # remote requests and this engine's own transfers alike.
        self._engine.deregister_memory(desc.id)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        pass  # endpoints are made at the first transfer

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        # As a target this engine serves any engine holding the token, registered or not (as MORI):
        # the ticket issued to desc.key stays valid.
        with self._lock:
            peer = self._peers.pop(desc.key, None)
        if peer is not None:
            peer.close()

    def submit(self, request: TransferRequest) -> Completion:
        peer = self._peers.get(request.remote.engine_key)
        if peer is not None and peer.healthy():
            return self._start(peer, request)
        if self._closed:
            return Outcome(StatusCode.ERR_BAD_STATE, "RDMA backend is closed")
        return self._connector.submit(request)  # on the peer's own thread: an unreachable peer delays no other

    def _start(self, peer: Any, request: TransferRequest) -> Completion:
        # One native call: the engine checks the rows against the local registration, plans, posts
        # and completes the whole batch (GIL released); no Python runs per block.
        try:
            return peer.submit(
                request.op,
                request.local.id,
                request.batch,
                request.remote.id,
                request.uid,
                request.notify and self._notify,
                request.remote.loc == MemoryLocationType.GPU,
            )
        except (ValueError, RuntimeError) as err:
            return _refused(err)

    def lane(self, local: MemoryDesc, remote: MemoryDesc) -> Lane | None:
        peer = self._peers.get(remote.engine_key)
        if peer is None or not peer.healthy():
            return None
        # The pair's ids and flags bound natively: a start runs no Python, and a refusal comes back
        # as a failed completion worded as _refused's.
        native = peer.lane(local.id, remote.id, self._notify, remote.loc == MemoryLocationType.GPU, "RDMA backend: ")
        # The engine's deregister_memory waits for its own transfers on the region (each ends
        # within MORI_IO_TIMEOUT) and refuses new ones at once.
        return Lane(native.start, drained=True, finished=ucx.FINISHED)

    def _start_accepted(self, peer: Any, request: TransferRequest) -> Completion:
        """Starts a transfer that waited for its peer's first contact (on the connector's thread).
        Its caller holds it as running already, so a full send queue cannot refuse it any more:
        it waits for room until ``MORI_IO_TIMEOUT``, as long as the queue keeps refusing."""
        deadline = time.monotonic() + self.ctx.io_timeout()
        while True:
            completion = self._start(peer, request)
            if (
                completion.code() != StatusCode.ERR_RDMA_OP
                or not completion.message().startswith("SQ full")
                or time.monotonic() >= deadline
            ):
                return completion

    def abort(self, remote_key: str) -> None:
        with self._lock:
            peer = self._peers.pop(remote_key, None)
        if peer is not None:
            # Forced close: the peer's transfers fail and UCX cancels what they had posted.
            peer.fail(f"transfers to engine {remote_key!r} were aborted (MORI_IO_TIMEOUT)")

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = self._connector.closed = True  # transfers still connecting fail from now on
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.close()
        self._engine.close()
