"""The TCP backend: host memory over the native data plane of mori-core (``TcpTarget``/``TcpPeer``).

The data plane listens on its own port, published to peers through the control op
``tcp.info``. Connections to a peer are opened at its first transfer; a broken connection makes
the backend unhealthy towards that peer (the router fails over) and is reopened on next use.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mori.core import _native  # type: ignore[attr-defined]  # compiled, no stubs

from .._control import ControlError
from ..types import (
    BackendType,
    EngineDesc,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
    TcpBackendConfig,
    TransferStatus,
)
from .base import Backend, BackendContext, TransferOp, TransferRequest

__all__ = ["TcpBackend"]

_NATIVE_OP = {TransferOp.READ: 1, TransferOp.WRITE: 2}


class TcpBackend(Backend):
    """Moves host memory over TCP: several connections per peer, batches as one native call."""

    kind = BackendType.TCP
    priority = 10

    def __init__(self, ctx: BackendContext, config: Any = None) -> None:
        if config is None:
            config = TcpBackendConfig()
        if not isinstance(config, TcpBackendConfig):
            raise TypeError(f"the TCP backend takes a TcpBackendConfig, got {type(config).__name__}")
        super().__init__(ctx, config)
        self._target = _native.TcpTarget(ctx.host, 0, ctx.auth_token(), ctx.io_timeout())
        self._peers: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._connector = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mori-io-tcp-connect")
        ctx.add_control_handler("tcp.info", lambda key, body: {"port": self._target.port})

    @property
    def port(self) -> int:
        """The data-plane port."""
        return int(self._target.port)

    def can_serve(self, local: MemoryDesc, remote: MemoryDesc) -> bool:
        return local.loc == MemoryLocationType.CPU and remote.loc == MemoryLocationType.CPU

    def healthy(self, remote_key: str) -> bool:
        peer = self._peers.get(remote_key)
        return peer is None or bool(peer.healthy())

    def register_memory(self, desc: MemoryDesc) -> MemoryDesc:
        if desc.loc == MemoryLocationType.CPU:
            self._target.register_region(desc.id, desc.data, desc.size)
        return desc

    def deregister_memory(self, desc: MemoryDesc) -> None:
        self._target.deregister_region(desc.id)

    def register_remote_engine(self, desc: EngineDesc) -> None:
        self._target.allow_peer(desc.key)

    def deregister_remote_engine(self, desc: EngineDesc) -> None:
        self._target.disallow_peer(desc.key)
        with self._lock:
            peer = self._peers.pop(desc.key, None)
        if peer is not None:
            peer.close()

    def _peer(self, remote_key: str) -> Any:
        with self._lock:
            peer = self._peers.get(remote_key)
            if peer is not None and peer.healthy():
                return peer
            if peer is not None:
                peer.close()
                del self._peers[remote_key]
            desc = self.ctx.remote_engine(remote_key)
            port = int(self.ctx.control_request(remote_key, "tcp.info", {})["port"])
            peer = _native.TcpPeer(remote_key, desc.host, port, self.config.num_connections, self.ctx.engine_key,
                                   self.ctx.auth_token(), self.ctx.io_timeout())
            self._peers[remote_key] = peer
            return peer

    def submit(self, request: TransferRequest) -> None:
        peer = self._peers.get(request.remote.engine_key)
        if peer is not None and peer.healthy():
            self._start(peer, request)
        else:
            # Connecting can take up to MORI_IO_TIMEOUT: do it off the caller's thread so that
            # submitting stays asynchronous; the status stays IN_PROGRESS meanwhile.
            request.status._set(StatusCode.IN_PROGRESS)
            self._connector.submit(self._connect_and_start, request)

    def _connect_and_start(self, request: TransferRequest) -> None:
        key = request.remote.engine_key
        if self._closed:
            request.status._set(StatusCode.ERR_BAD_STATE, "TCP backend was closed before the transfer started")
            return
        try:
            peer = self._peer(key)
        except ControlError as err:
            request.status._set(err.code, f"TCP backend: {err}")
            return
        except (KeyError, TimeoutError, RuntimeError, OSError) as err:
            code = StatusCode.ERR_NOT_FOUND if isinstance(err, KeyError) else StatusCode.ERR_BAD_STATE
            request.status._set(code, f"TCP backend: cannot reach engine {key!r}: {err}")
            return
        self._start(peer, request)

    def _start(self, peer: Any, request: TransferRequest) -> None:
        # numpy batches go in as arrays (one memcpy each), lists element by element.
        submit = peer.submit_arrays if hasattr(request.sizes, "dtype") else peer.submit
        transfer = submit(_NATIVE_OP[request.op], request.local.data, request.local_offsets, request.remote.id,
                               request.remote_offsets, request.sizes, request.uid,
                               request.notify and self.config.enable_notification, self.config.stripe_bytes)
        request.status._attach(transfer)

    def pop_inbound(self, remote_key: str, uid: int) -> TransferStatus | None:
        code = self._target.pop_inbound(remote_key, uid)
        return None if code is None else TransferStatus(StatusCode(code))

    def close(self) -> None:
        self._closed = True
        self._connector.shutdown(wait=True)  # queued requests fail fast now that _closed is set
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.close()
        self._target.close()
