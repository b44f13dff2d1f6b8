"""The NVLink backend (MORI's XGMI backend): one-sided copies between GPUs of one host.

Registration exports a handle of each GPU region (``_peer_memory``) into ``MemoryDesc.extra``.
The first transfer towards a remote region asks its owner (control op ``nvlink.open``, carrying
the asking engine's descriptor: the owner need not have registered it) on a thread of that region's
own (``PeerConnector``: the caller never waits for it, and an owner that does not answer delays
only transfers to its regions), which checks that the
region is registered, answers with what it registered (handle, size) and remembers who opened it
and where that engine listens. The initiator maps the
region once per (engine, memory id) and from then on copies directly: large blocks with the
copy engines over a pool of streams, small blocks with one gather-kernel launch (the split is
``MORI_IO_NVLINK_KERNEL_MAX``, chosen by measurement; see ``plan``).

A transfer completes when its CUDA events fire (seen by whoever polls its status); the owner of
the remote region then gets an inbound record (``BackendContext.send_completions``), sent in
batches by a housekeeping thread that also finishes transfers nobody polls (``_housekeeping``).
When the owner deregisters a region, or the engine that opened it, it revokes the mapping
(``nvlink.revoke``): the initiator drops it after its in-flight copies finish, so later transfers
fail with ``ERR_NOT_FOUND`` and touch nothing. The parts: ``_exports`` (the target side: exported
regions and who opened them), ``_remote_regions`` (the initiator side: regions opened and mapped
here), ``_housekeeping`` (transfers in flight, records owed), ``_queues`` and ``_kernels`` (the
copies), ``plan`` (a batch cut between the kernel and the copy engines).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mori.core import config as mori_config
from mori.core import cuda as _cuda
from mori.core.host import this_host

from ...types import BackendType, EngineDesc, MemoryDesc, MemoryLocationType, StatusCode, XgmiBackendConfig
from .._connect import PeerConnector
from ..base import Backend, BackendContext, Completion, ControlError, Outcome, TransferOp, TransferRequest
from ._exports import Exports
from ._housekeeping import Flight, Housekeeping
from ._queues import DeviceQueues
from ._remote_regions import Opened, RemoteRegions
from .plan import plan_batch

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
        # One lock for the three parts: a copy starts only on a region still opened, and a region
        # is released only once no copy uses it.
        self._lock = threading.RLock()
        self._exports = Exports(ctx, self._lock)
        self._regions = RemoteRegions(ctx, self._host, self._lock)
        self._queues: dict[int, DeviceQueues] = {}
        self._unhealthy: set[str] = set()
        self._closed = False
        self._work = Housekeeping(ctx, self._lock)
        self._connector = PeerConnector("NVLink", self._map, self._start, lambda r: (r.remote.engine_key, r.remote.id))
        ctx.add_control_handler("nvlink.open", self._exports.handle_open)
        ctx.add_control_handler("nvlink.revoke", self._handle_revoke)

    # ---- routing -------------------------------------------------------------------------------
    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        info = remote.extra.get("nvlink")
        return (
            local.loc == MemoryLocationType.GPU
            and remote.loc == MemoryLocationType.GPU
            and "nvlink" in local.extra
            and isinstance(info, dict)
            and info.get("host") == self._host
        )

    def healthy(self, remote_key: str) -> bool:
        return remote_key not in self._unhealthy

    # ---- local memory (this engine as target) --------------------------------------------------
    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        return self._exports.add(desc) if desc.loc == MemoryLocationType.GPU else desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        exported, openers = self._exports.remove(desc.id)
        # Our own transfers that use the region locally end first.
        self._work.drain(lambda f: f.request.local.id == desc.id, f"memory {desc.id}")
        for key in sorted(openers):
            self._exports.revoke(openers[key], [desc.id])
        if exported is not None:
            exported.close()

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

    def _forget(self, keys: list[tuple[str, int]], revoked: bool) -> None:
        """Drops the mappings of remote regions ``keys`` once no copy uses them."""
        dropped = self._regions.drop(keys, revoked)
        wanted = set(keys)
        self._work.drain(lambda f: f.remote in wanted, f"remote memory {sorted(wanted)}")
        for opened in dropped:
            self._regions.release(opened.mapping_key)

    def _handle_revoke(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        self._forget([(key, int(i)) for i in body["ids"]], revoked=True)
        return {}

    def register_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            self._unhealthy.discard(desc.key)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        mine = self._regions.of_engine(desc.key)
        theirs = self._exports.opened_by(desc.key)
        self._forget(mine, revoked=False)
        self._exports.revoke(desc, theirs)

    # ---- transfers -----------------------------------------------------------------------------
    def submit(self, request: TransferRequest) -> Completion:
        opened = self._regions.get((request.remote.engine_key, request.remote.id))
        if opened is None:
            # First contact with the region (ask its owner, map it: up to MORI_IO_TIMEOUT) on
            # that region's own thread, never the caller's.
            return self._connector.submit(request)
        return self._start(opened, request)

    def _map(self, request: TransferRequest) -> Opened:
        """Opens the request's remote region (run by the connector's thread)."""
        remote = request.remote
        try:
            return self._regions.open(remote, request.local.device_id)
        except ControlError:
            raise
        except (TimeoutError, OSError, ValueError, _cuda.CudaError) as err:
            code = StatusCode.ERR_GPU_OP if isinstance(err, _cuda.CudaError) else StatusCode.ERR_BAD_STATE
            with self._lock:
                self._unhealthy.add(remote.engine_key)
            raise ControlError(code, f"cannot map memory {remote.id} of engine {remote.engine_key!r}: {err}") from err

    def _start(self, opened: Opened, request: TransferRequest) -> Completion:
        remote, device = request.remote, request.local.device_id
        batch = request.batch
        # The engine checked every block against the descriptor; the owner's registered size
        # needs its own check only when the descriptor claims more (a forged or stale one).
        if remote.size > opened.size and batch.dst_end > opened.size:
            return Outcome(
                StatusCode.ERR_INVALID_ARGS,
                f"NVLink backend: a block is out of range of remote memory "
                f"{remote.id} ({opened.size} bytes registered by its owner)",
            )
        try:
            queues = self._device(device)
            # A batch is planned straight into the pinned table the gather kernel will read.
            table = queues.kernel.tables.take(len(batch)) if len(batch) > 1 else None
            try:
                plan = plan_batch(
                    batch,
                    opened.address,
                    request.op == TransferOp.READ,
                    self._kernel_max,
                    STRIPE,
                    ENGINE_STREAMS,
                    None if table is None else table.rows,
                    ENGINE_SHARE,
                )
            except BaseException:
                if table is not None:
                    queues.kernel.tables.give(table)
                raise
            with self._lock:
                if self._regions.get((remote.engine_key, remote.id)) is not opened:
                    if table is not None:
                        queues.kernel.tables.give(table)
                    return Outcome(
                        StatusCode.ERR_NOT_FOUND,
                        f"NVLink backend: memory {remote.id} of engine {remote.engine_key!r} was deregistered",
                    )
                events, tables = queues.issue(plan, table)
                transfer = queues.transfer(events, tables, time.monotonic() + self.ctx.io_timeout(), self._work.on_done)
                if events:
                    self._work.add(transfer, Flight(request, (remote.engine_key, remote.id)))
        except _cuda.CudaError as err:
            self._work.note(request, StatusCode.ERR_GPU_OP, str(err))
            return Outcome(StatusCode.ERR_GPU_OP, f"NVLink backend: {err}")
        if events:
            return transfer
        self._work.note(request, StatusCode.SUCCESS, "")  # nothing to copy (zero bytes)
        return Outcome(StatusCode.SUCCESS)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._connector.closed = True  # regions still being opened fail their transfers
        self._work.drain(lambda f: True, "any memory")
        self._work.stop()
        with self._lock:
            queues, self._queues = list(self._queues.values()), {}
        self._regions.close()
        self._exports.close()
        for q in queues:
            _cuda.init_device(q.device)
            q.close()
