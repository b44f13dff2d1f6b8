"""A node's data plane: its mori-io engine, the memory registered with it (the store's DRAM
buffer, the caller's buffers, a staging buffer), and its peers (their engines, buffers and peer
services).

Pages move between the caller's registered buffers and a peer's DRAM buffer in one mori-io
transfer per peer and batch, zero-copy; a page at an address no registered buffer covers goes
through the staging buffer (a memcpy on this side). The backend is TCP, or RDMA (UCX) with
``UMBP_IO_BACKEND=rdma``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from mori.core.log import get_logger
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
)

from . import _grpc
from ._env import runtime_int
from ._hostmem import allocate_host_buffer, free_host_buffer
from ._master._proto import umbp_peer_pb2 as pb
from ._master._proto import umbp_peer_pb2_grpc as pb_grpc

_log = get_logger("umbp")
_RESPONSES = _grpc.response_types(pb, "UMBPPeer")
#: The largest answer a peer's service sends (a resolve of the most keys is far smaller).
_MAX_ANSWER_BYTES = 16 << 20


class PeerUnavailableError(RuntimeError):
    """A peer's service or engine did not answer in time, or refused the call."""


class PeerChannel:
    """A channel to a peer's service on the gRPC transport :func:`._grpc.native` picks;
    :meth:`call` makes one call of ``umbp.UMBPPeer``."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        native = _grpc.native()
        # A resolve's answer may carry pages (inline_max_bytes): the channel pings as they come.
        self._native = (
            None if native is None else _grpc.NativeChannel(native, address, _MAX_ANSWER_BYTES, bdp_probe=True)
        )
        self._channel: grpc.Channel | None = None
        if self._native is None:
            self._channel = grpc.insecure_channel(
                address, options=[("grpc.max_receive_message_length", _MAX_ANSWER_BYTES)]
            )
            self._stub = pb_grpc.UMBPPeerStub(self._channel)

    def call(self, rpc: str, request: object) -> Any:
        """``rpc`` with ``request`` within the deadline; PeerUnavailableError on any failure."""
        try:
            if self._native is not None:
                return self._native.unary(f"/umbp.UMBPPeer/{rpc}", request, _RESPONSES[rpc], self.timeout_s)
            return getattr(self._stub, rpc)(request, timeout=self.timeout_s)
        except _grpc.RpcFailure as exc:
            raise PeerUnavailableError(f"peer {self.address}: {exc}") from None
        except grpc.RpcError as exc:
            raise PeerUnavailableError(f"peer {self.address}: {exc.code().name}: {exc.details()}") from None
        except ValueError as exc:  # the channel was closed: the peer was forgotten after a failure
            raise PeerUnavailableError(f"peer {self.address}: {exc}") from None

    def close(self) -> None:
        if self._native is not None:
            self._native.close()
        elif self._channel is not None:
            self._channel.close()


@dataclasses.dataclass
class Peer:
    """What this node knows of a peer: its service's channel, its engine, its DRAM buffer."""

    address: str
    channel: PeerChannel
    engine: EngineDesc
    buffer: MemoryDesc

    def call(self, rpc: str, request: object) -> Any:
        """One call of the peer's service (see :meth:`PeerChannel.call`)."""
        return self.channel.call(rpc, request)


@dataclasses.dataclass(frozen=True)
class Move:
    """One page to move: ``size`` bytes at local address ``address`` and at ``remote_offset``
    in the peer's DRAM buffer."""

    address: int
    size: int
    remote_offset: int


class Transport:
    """The mori-io side of one node (see the module's docstring)."""

    def __init__(
        self, name: str, host: str, port: int, buffer_address: int, buffer_size: int, staging_size: int
    ) -> None:
        self.rpc_timeout_s = runtime_int("UMBP_PEER_RPC_TIMEOUT_MS", 5000, 1) / 1000
        self.io_timeout_ms = runtime_int("UMBP_TRANSFER_TIMEOUT_MS", 30000, 1)
        self.engine = IOEngine(name, IOEngineConfig(host=host, port=port))
        backend = os.environ.get("UMBP_IO_BACKEND", "tcp").strip().lower()
        if backend not in ("tcp", "rdma"):
            raise ValueError(f"UMBP_IO_BACKEND={backend!r}: expected tcp or rdma")
        self.engine.create_backend(BackendType.RDMA if backend == "rdma" else BackendType.TCP)
        #: ``tcp`` or ``rdma`` (``UMBP_IO_BACKEND``).
        self.backend = backend
        self.buffer = self.engine.register_memory(buffer_address, buffer_size, -1, MemoryLocationType.CPU)
        self._staging_handle = allocate_host_buffer(staging_size, prefault=False)
        if not self._staging_handle:
            raise MemoryError(f"no host memory for the staging buffer ({staging_size} bytes)")
        self._staging = self.engine.register_memory(self._staging_handle.ptr, staging_size, -1, MemoryLocationType.CPU)
        self.staging_size = staging_size
        self._staging_lock = threading.Lock()
        self._regions: dict[int, tuple[int, MemoryDesc]] = {}
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()

    @property
    def engine_desc(self) -> bytes:
        return self.engine.get_engine_desc().pack()

    # -- the caller's buffers -----------------------------------------------------------------

    def register_region(self, ptr: int, size: int) -> None:
        """Registers the caller's buffer with the engine, for zero-copy moves."""
        with self._lock:
            if ptr in self._regions and self._regions[ptr][0] >= size:
                return
        desc = self.engine.register_memory(ptr, size, -1, MemoryLocationType.CPU)
        with self._lock:
            old = self._regions.get(ptr)
            self._regions[ptr] = (size, desc)
        if old is not None:
            self.engine.deregister_memory(old[1])

    def deregister_region(self, ptr: int) -> None:
        with self._lock:
            old = self._regions.pop(ptr, None)
        if old is not None:
            self.engine.deregister_memory(old[1])

    def _region_of(self, address: int, size: int) -> tuple[MemoryDesc, int] | None:
        with self._lock:
            for start, (length, desc) in self._regions.items():
                if start <= address and address + size <= start + length:
                    return desc, address - start
        return None

    # -- peers --------------------------------------------------------------------------------

    def peer(self, address: str) -> Peer:
        """The peer at ``address`` (its service's ``host:port``), met on first use."""
        with self._lock:
            known = self._peers.get(address)
        if known is not None:
            return known
        channel = PeerChannel(address, self.rpc_timeout_s)
        try:
            info = channel.call("GetPeerInfo", pb.GetPeerInfoRequest())
            engine, buffer = EngineDesc.unpack(info.engine_desc), MemoryDesc.unpack(info.buffer_desc)
        except (PeerUnavailableError, ValueError) as exc:
            channel.close()
            raise PeerUnavailableError(f"peer {address}: {exc}") from None
        self.engine.register_remote_engine(engine)
        peer = Peer(address, channel, engine, buffer)
        with self._lock:
            self._peers.setdefault(address, peer)
            return self._peers[address]

    def forget(self, address: str) -> None:
        """Drops what is known of a peer (it failed; it is met again on next use)."""
        with self._lock:
            peer = self._peers.pop(address, None)
        if peer is not None:
            peer.channel.close()
            with contextlib.suppress(KeyError):  # another thread forgot it first
                self.engine.deregister_remote_engine(peer.engine)

    # -- moving pages -------------------------------------------------------------------------

    def write(self, peer: Peer, moves: Sequence[Move]) -> list[bool]:
        """Writes each page into the peer's buffer; one result per page."""
        return self._move(peer, moves, write=True)

    def read(self, peer: Peer, moves: Sequence[Move]) -> list[bool]:
        """Reads each page from the peer's buffer; one result per page."""
        return self._move(peer, moves, write=False)

    def _move(self, peer: Peer, moves: Sequence[Move], write: bool) -> list[bool]:
        results = [False] * len(moves)
        direct: dict[int, tuple[MemoryDesc, list[int], list[int]]] = {}
        staged: list[int] = []
        for i, move in enumerate(moves):
            found = self._region_of(move.address, move.size)
            if found is None:
                staged.append(i)
            else:
                group = direct.setdefault(found[0].id, (found[0], [], []))
                group[1].append(i)
                group[2].append(found[1])
        for desc, indices, offsets in direct.values():
            ok = self._transfer(peer, desc, offsets, [moves[i] for i in indices], write)
            for i in indices:
                results[i] = ok
        if staged:
            with self._staging_lock:
                for batch in self._staging_rounds(moves, staged):
                    offsets, used = [], 0
                    for i in batch:
                        offsets.append(used)
                        if write:
                            ctypes.memmove(self._staging_handle.ptr + used, moves[i].address, moves[i].size)
                        used += moves[i].size
                    ok = self._transfer(peer, self._staging, offsets, [moves[i] for i in batch], write)
                    for i, offset in zip(batch, offsets):
                        if ok and not write:
                            ctypes.memmove(moves[i].address, self._staging_handle.ptr + offset, moves[i].size)
                        results[i] = ok
        return results

    def _staging_rounds(self, moves: Sequence[Move], indices: list[int]) -> list[list[int]]:
        """``indices`` in rounds that fit the staging buffer (a page larger than it fails)."""
        rounds: list[list[int]] = []
        current: list[int] = []
        used = 0
        for i in indices:
            size = moves[i].size
            if size > self.staging_size:
                _log.warning("a %d-byte page at an unregistered address is larger than the staging buffer", size)
                continue
            if used + size > self.staging_size:
                rounds.append(current)
                current, used = [], 0
            current.append(i)
            used += size
        if current:
            rounds.append(current)
        return rounds

    def _transfer(
        self, peer: Peer, local: MemoryDesc, local_offsets: list[int], moves: Sequence[Move], write: bool
    ) -> bool:
        if not moves:
            return True
        remote_offsets = [m.remote_offset for m in moves]
        sizes = [m.size for m in moves]
        uid = self.engine.allocate_transfer_uid()
        op = self.engine.batch_write if write else self.engine.batch_read
        try:
            status = op(local, local_offsets, peer.buffer, remote_offsets, sizes, uid)
            code = IOEngine.wait_all([status], self.io_timeout_ms)
        except Exception as exc:  # a peer that vanished mid-transfer fails the transfer, not the client
            _log.warning(
                "%s of %d pages with %s failed: %s", "write" if write else "read", len(moves), peer.address, exc
            )
            self.forget(peer.address)
            return False
        if code != StatusCode.SUCCESS or not status.Succeeded():
            _log.warning(
                "%s of %d pages with %s failed: %s",
                "write" if write else "read",
                len(moves),
                peer.address,
                status.Message(),
            )
            self.forget(peer.address)
            return False
        return True

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.channel.close()
        self.engine.close()
        free_host_buffer(self._staging_handle)
