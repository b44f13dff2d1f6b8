"""The TCP backend: memory over the native data plane of mori-core (:mod:`mori.core.tcp`).

The data plane listens on its own port, published to peers through the control op
``tcp.info``. Connections to a peer are opened at its first transfer; a broken connection makes
the backend unhealthy towards that peer (the router fails over) and is reopened on next use.
Host memory moves directly; GPU memory (either side) is staged through pinned host buffers
(``_gpu``), which needs cuda-bindings and a GPU where the GPU memory is.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any

from mori.core import config as mori_config
from mori.core import tcp as _tcp

from ...types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
)
from .._connect import PeerConnector
from ..base import Backend, BackendContext, Completion, ControlError, TransferRequest
from ._staging_size import chunk_bytes_for

__all__ = ["TcpBackend"]

_GPU_OPS = ("read", "lend", "commit", "return")
_SERVED = (MemoryLocationType.CPU, MemoryLocationType.GPU)


class TcpBackend(Backend):
    """Moves memory over TCP: several connections per peer, batches as one native call; GPU
    memory staged through pinned host buffers."""

    kind = BackendType.TCP
    priority = 10

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        if config is None:
            config = TcpBackendConfig()
        if not isinstance(config, TcpBackendConfig):
            raise TypeError(f"the TCP backend takes a TcpBackendConfig, got {type(config).__name__}")
        super().__init__(ctx, config)
        self._staging_bytes = int(mori_config.get("MORI_IO_TCP_STAGING_SIZE"))
        self._chunk = chunk_bytes_for(self._staging_bytes)  # a bad size fails here, not at the first transfer
        lim = ctx.limits
        self._target = _tcp.Target(ctx.host, 0, ctx.auth_token(), ctx.io_timeout(),
                                   max_connections=lim.max_connections, max_handshakes=lim.max_handshakes,
                                   hello_timeout=lim.hello_timeout, timeout_setting="MORI_IO_TIMEOUT",
                                   inbound=ctx.inbound)
        self._peers: dict[str, Any] = {}
        self._connector = PeerConnector("TCP", self._connect_peer, self._start)
        self._remote_chunk: dict[str, int] = {}
        self._gpu: Any = None  # _gpu.GpuStaging, made at the first GPU registration or transfer
        self._lock = threading.Lock()
        self._closed = False
        ctx.add_control_handler("tcp.info", self._handle_info)
        for op in _GPU_OPS:
            ctx.add_control_handler(f"tcp.gpu_{op}", self._gpu_handler(op))

    def _handle_info(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        # The ticket admits data connections claiming the key this control session authenticated
        # as: a key cannot be claimed on the data plane alone.
        ticket = secrets.token_hex(16)
        self._target.issue_ticket(key, ticket)
        return {"port": self._target.port, "staging_chunk": self._chunk, "ticket": ticket}

    @property
    def port(self) -> int:
        """The data-plane port."""
        return int(self._target.port)

    def _staging(self) -> Any:
        with self._lock:
            if self._gpu is None:
                from ._gpu import GpuStaging  # numpy and cuda-bindings: only for GPU memory

                self._gpu = GpuStaging(self.ctx, self._staging_bytes, self._target.register_region,
                                       self._target.deregister_region, self.config.stripe_bytes,
                                       self.config.enable_notification)
            return self._gpu

    def _gpu_handler(self, op: str) -> Any:
        def handle(key: str, body: dict[str, Any]) -> dict[str, Any]:
            if self._gpu is None:
                raise ControlError(StatusCode.ERR_NOT_FOUND, f"engine {self.ctx.engine_key!r} has no GPU memory "
                                                             "registered with its TCP backend")
            return dict(getattr(self._gpu, f"handle_{op}")(key, body))

        return handle

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
            self._staging().add_region(desc)
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        if desc.loc == MemoryLocationType.GPU and self._gpu is not None:
            self._gpu.remove_region(desc.id)
        else:
            self._target.deregister_region(desc.id)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        pass  # connections are opened at the first transfer

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        if self._gpu is not None:
            self._gpu.leases.release_engine(desc.key)
        with self._lock:
            peer = self._peers.pop(desc.key, None)
        if peer is not None:
            peer.close()

    def _open_peer(self, remote_key: str) -> Any:
        """Connects to ``remote_key``'s data plane (no lock held: this can take MORI_IO_TIMEOUT)."""
        desc = self.ctx.remote_engine(remote_key)
        info = self.ctx.control_request(remote_key, "tcp.info", {})
        chunk = int(info.get("staging_chunk", self._chunk))
        peer = _tcp.Peer(remote_key, desc.host, int(info["port"]), self.config.num_connections,
                         self.ctx.engine_key, self.ctx.auth_token(), str(info.get("ticket", "")),
                         self.ctx.io_timeout(), timeout_setting="MORI_IO_TIMEOUT")
        with self._lock:
            self._remote_chunk[remote_key] = chunk
        return peer

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
        if request.local.loc == MemoryLocationType.GPU or request.remote.loc == MemoryLocationType.GPU:
            key = request.remote.engine_key
            return self._staging().submit(peer, request, self._remote_chunk.get(key, self._chunk))
        return peer.submit(request.op, request.batch, request.remote.id, request.uid,
                           request.notify and self.config.enable_notification, self.config.stripe_bytes)

    def close(self) -> None:
        self._closed = self._connector.closed = True  # connecting threads fail their transfers from now on
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        if self._gpu is not None:
            self._gpu.close()  # its transfers end (bounded by MORI_IO_TIMEOUT) before the peers close
        for p in peers:
            p.close()
        self._target.close()
