"""The TCP backend: memory over the native data plane of mori-core (:mod:`mori.core.tcp`).

The data plane listens on its own port, published to peers through the control op
``tcp.info``. Connections to a peer are opened at its first transfer; a broken connection makes
the backend unhealthy towards that peer (the router fails over) and is reopened on next use.
Host memory moves directly. GPU memory, at either end, is staged by the data plane itself
through mori-core's native staging (:mod:`mori.core.staging`): the target registers a GPU region
with its device's stager, the initiator passes its local GPU region's stager with the transfer,
and each end copies its blocks between the GPU and pinned host memory piece by piece while the
socket moves others. No Python runs per transfer; GPU memory needs cuda-bindings and a GPU where
it lives.
"""

from __future__ import annotations

import threading
from typing import Any

from mori.core import tcp as _tcp

from ...types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    TcpBackendConfig,
)
from .._connect import PeerConnector
from .._gpu_staging import stager_for
from ..base import Backend, BackendContext, Completion, Lane, TransferOp, TransferRequest

__all__ = ["TcpBackend"]

_SERVED = (MemoryLocationType.CPU, MemoryLocationType.GPU)


class TcpBackend(Backend):
    """Moves memory over TCP: several connections per peer, batches as one native call; GPU
    memory staged natively at whichever end it lives."""

    kind = BackendType.TCP
    priority = 10

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        if config is None:
            config = TcpBackendConfig()
        if not isinstance(config, TcpBackendConfig):
            raise TypeError(f"the TCP backend takes a TcpBackendConfig, got {type(config).__name__}")
        super().__init__(ctx, config)
        lim = ctx.limits
        self._target = _tcp.Target(
            ctx.host,
            0,
            ctx.auth_token(),
            ctx.io_timeout(),
            max_connections=lim.max_connections,
            max_handshakes=lim.max_handshakes,
            hello_timeout=lim.hello_timeout,
            timeout_setting="MORI_IO_TIMEOUT",
            inbound=ctx.inbound,
        )
        self._peers: dict[str, Any] = {}
        self._connector = PeerConnector("TCP", self._connect_peer, self._start)
        self._staging: dict[int, Any] = {}  # local GPU region id -> its mori.core.staging.Stager
        self._lock = threading.Lock()
        self._closed = False
        ctx.add_control_handler("tcp.info", self._handle_info)

    def _handle_info(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        # The ticket admits data connections claiming the key this control session authenticated
        # as: a key cannot be claimed on the data plane alone. The target draws it (one per key,
        # renewed at every issue).
        return {"port": self._target.port, "ticket": self._target.issue_ticket(key)}

    @property
    def port(self) -> int:
        """The data-plane port."""
        return int(self._target.port)

    def describe(self) -> dict[str, Any]:
        return {"port": self.port, "gpu_memory": "staged through pinned host memory by the native data plane"}

    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        # GPU memory is staged at whichever end it lives: a local GPU region exists only if its
        # registration (which checks CUDA) succeeded; a remote one is checked by its owner.
        return local.loc in _SERVED and remote.loc in _SERVED

    def healthy(self, remote_key: str) -> bool:
        peer = self._peers.get(remote_key)
        return peer is None or bool(peer.healthy())

    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        if desc.loc == MemoryLocationType.CPU:
            self._target.register_region(desc.id, desc.data, desc.size)
        elif desc.loc == MemoryLocationType.GPU:
            stager = stager_for(self.ctx, desc, "TCP backend")
            self._target.register_region(desc.id, desc.data, desc.size, staging=stager)
            with self._lock:
                self._staging[desc.id] = stager
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        # Refuses new requests at once; waits (within MORI_IO_TIMEOUT) for those in flight, staged
        # copies included, then cuts connections still touching it.
        self._target.deregister_region(desc.id)
        with self._lock:
            self._staging.pop(desc.id, None)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        pass  # connections are opened at the first transfer

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        with self._lock:
            peer = self._peers.pop(desc.key, None)
        if peer is not None:
            peer.close()

    def _open_peer(self, remote_key: str) -> Any:
        """Connects to ``remote_key``'s data plane (no lock held: this can take MORI_IO_TIMEOUT)."""
        desc = self.ctx.remote_engine(remote_key)
        info = self.ctx.control_request(remote_key, "tcp.info", {})
        return _tcp.Peer(
            remote_key,
            desc.host,
            int(info["port"]),
            self.config.num_connections,
            self.ctx.engine_key,
            self.ctx.auth_token(),
            str(info.get("ticket", "")),
            self.ctx.io_timeout(),
            timeout_setting="MORI_IO_TIMEOUT",
        )

    def _connect_peer(self, request: TransferRequest) -> Any:
        """Opens the peer's connections and publishes them (run by the connector's thread)."""
        key = request.remote.engine_key
        peer = self._open_peer(key)
        with self._lock:
            closed = self._closed
            old = None if closed else self._peers.get(key)
            if not closed:
                self._peers[key] = peer
        if closed:
            peer.close()
            raise RuntimeError("TCP backend was closed before the transfer started")
        if old is not None:
            old.close()
        return peer

    def submit(self, request: TransferRequest) -> Completion:
        peer = self._peers.get(request.remote.engine_key)
        if peer is not None and peer.healthy():
            return self._start(peer, request)
        return self._connector.submit(request)  # on the peer's own thread: see _connect

    def abort(self, remote_key: str) -> None:
        with self._lock:
            peer = self._peers.pop(remote_key, None)
        if peer is not None:
            peer.close()  # its transfers fail; its threads have stopped when this returns

    def _start(self, peer: Any, request: TransferRequest) -> Completion:
        # One native call: the rows are striped over the connections; local GPU memory is staged
        # by the data plane through its stager (the target stages its own).
        staging = self._staging.get(request.local.id) if request.local.loc == MemoryLocationType.GPU else None
        return peer.submit(
            request.op,
            request.batch,
            request.remote.id,
            request.uid,
            request.notify and self.config.enable_notification,
            self.config.stripe_bytes,
            staging,
        )

    def lane(self, local: MemoryDesc, remote: MemoryDesc) -> Lane | None:
        peer = self._peers.get(remote.engine_key)
        if peer is None or not peer.healthy():
            return None
        submit_one, remote_id = peer.submit_one, remote.id
        notify, stripe = bool(self.config.enable_notification), self.config.stripe_bytes
        staging = self._staging.get(local.id) if local.loc == MemoryLocationType.GPU else None

        def start(op: TransferOp, src: int, dst: int, size: int, uid: int) -> Completion | None:
            # As _start, with no Batch made for the one row; None once a connection has failed.
            return submit_one(op, src, dst, size, remote_id, uid, notify, stripe, staging)  # type: ignore[no-any-return]

        return Lane(start)

    def close(self) -> None:
        self._closed = self._connector.closed = True  # connecting threads fail their transfers from now on
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.close()
        self._target.close()
