"""Sharing GPU memory between processes of one host for the NVLink backend.

Two kinds of memory, two kinds of handle (carried in ``MemoryDesc.extra["nvlink"]``):

* ``ipc`` — memory from ``cudaMalloc`` (PyTorch's caching allocator included): a legacy CUDA
  IPC handle of the *base* of the allocation that holds the region (``cuMemGetAddressRange``),
  plus the region's offset inside it. A tensor sub-allocated from a larger block (MORI's bug
  #415) therefore maps correctly: the importer opens the whole block and adds the offset.
* ``vmm`` — memory from ``cuMemCreate`` with the POSIX-fd handle type (``mori.core.memory
  .cuda_vmm``), exported as a file descriptor by ``cuda_vmm.export_allocation_fd``; file
  descriptors cannot travel in msgpack, so the owner serves them over an
  abstract Unix socket (:class:`FdServer`) to whoever presents a one-time nonce obtained over the
  authenticated control plane; the importer maps the allocation with ``VmmAllocation.import_fd``.

A process never opens its own handles: when initiator and target engines share a process the
registered address is used as is (:func:`open_mapping`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from mori.core import cuda as _cuda
from mori.core.host import this_host
from mori.core.memory import cuda_vmm, recv_fds, send_fds

__all__ = ["export_region", "ExportedRegion", "Mapping", "open_mapping", "enable_peer_access", "FdServer", "fetch_fd"]

_IPC_HANDLE_BYTES = 64
_NONCE_BYTES = 32
_NONCE_WAIT_S = 1.0  # a peer sends its nonce the moment it connects
_MAX_GRANTS = 4096


def _attr(name: str, ptr: int) -> int:
    attr = getattr(_cuda.driver().CUpointer_attribute, name)
    return int(_cuda.call("cuPointerGetAttribute", attr, ptr, detail=f"pointer 0x{ptr:x}"))


@dataclass
class ExportedRegion:
    """A registered GPU region as peers need it: ``info`` goes into the descriptor; ``fd`` (VMM
    only) is the descriptor the :class:`FdServer` hands out, owned here until :meth:`close`."""

    info: dict[str, Any]
    fd: int = -1

    def close(self) -> None:
        """Closes the exported fd (importers keep their own references)."""
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def export_region(ptr: int, size: int, device: int) -> ExportedRegion:
    """Checks that ``[ptr, ptr+size)`` is GPU memory inside one allocation and makes its handle;
    raises ``ValueError`` naming what is wrong. ``device`` (the caller's ``device_id``) is the GPU
    whose streams and kernel copy to and from the region."""
    _cuda.init_device(device)
    drv = _cuda.driver()
    try:
        mem_type = _attr("CU_POINTER_ATTRIBUTE_MEMORY_TYPE", ptr)
    except _cuda.CudaError as err:
        raise ValueError(f"0x{ptr:x} is not GPU memory known to CUDA in this process ({err.name})") from None
    if mem_type != int(drv.CUmemorytype.CU_MEMORYTYPE_DEVICE):
        raise ValueError(f"0x{ptr:x} is not device memory (CUDA memory type {mem_type})")
    base, base_size = (int(v) for v in _cuda.call("cuMemGetAddressRange", ptr, detail=f"pointer 0x{ptr:x}"))
    if ptr + size > base + base_size:
        raise ValueError(
            f"region 0x{ptr:x} (+{size} bytes) runs past the end of its allocation 0x{base:x} (+{base_size} bytes)"
        )
    info: dict[str, Any] = {
        "offset": ptr - base,
        "base_size": base_size,
        "device": device,
        "pid": os.getpid(),
        "host": this_host().key,
    }
    if _attr("CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE", ptr):
        handle = _cuda.call("cuIpcGetMemHandle", base, detail=f"allocation 0x{base:x}")
        info.update(kind="ipc", handle=ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES))
        return ExportedRegion(info)
    try:
        fd = cuda_vmm.export_allocation_fd(ptr)
    except _cuda.CudaError as err:
        raise ValueError(
            f"GPU memory at 0x{ptr:x} is neither cudaMalloc memory (legacy IPC) nor a VMM allocation "
            f"exportable as a POSIX fd ({err.name}); allocate it with cudaMalloc/torch or "
            "mori.core.memory.cuda_vmm"
        ) from None
    info.update(kind="vmm")
    return ExportedRegion(info, fd)


def enable_peer_access(local_device: int, peer_device: int) -> None:
    """Lets kernels on ``local_device`` reach ``peer_device``'s memory (same process); idempotent."""
    if local_device == peer_device:
        return
    peer_ctx = _cuda.init_device(peer_device)
    _cuda.init_device(local_device)
    try:
        _cuda.call("cuCtxEnablePeerAccess", peer_ctx, 0)
    except _cuda.CudaError as err:
        if err.name != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
            raise


class Mapping:
    """A peer allocation mapped in this process; ``base`` is its address here."""

    def __init__(self, base: int, kind: str, device: int, closer: Any = None) -> None:
        self.base, self.kind, self.device = base, kind, device
        self._closer = closer

    def close(self) -> None:
        """Unmaps the allocation (IPC close or VMM free); idempotent."""
        closer, self._closer = self._closer, None
        if closer is not None:
            _cuda.init_device(self.device)
            closer()


def open_mapping(info: dict[str, Any], remote_data: int, local_device: int, fd: int = -1) -> Mapping:
    """Maps the allocation described by ``info`` (from :func:`export_region`) for ``local_device``.

    ``remote_data`` is the registered address in the owner's process (used as is when the owner
    is this process); ``fd`` is the VMM descriptor fetched from the owner (closed by the caller).
    """
    _cuda.init_device(local_device)
    if info["pid"] == os.getpid() and info["host"] == this_host().key:
        enable_peer_access(local_device, int(info["device"]))
        return Mapping(remote_data - int(info["offset"]), "local", local_device)
    if info["kind"] == "ipc":
        drv = _cuda.driver()
        handle = drv.CUipcMemHandle()
        ctypes.memmove(handle.getPtr(), bytes(info["handle"]), _IPC_HANDLE_BYTES)
        flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.value
        base = int(_cuda.call("cuIpcOpenMemHandle", handle, flags, detail=f"memory of process {info['pid']}"))
        return Mapping(base, "ipc", local_device, lambda: _cuda.call("cuIpcCloseMemHandle", base))
    alloc = cuda_vmm.VmmAllocation.import_fd(fd, int(info["base_size"]), local_device)
    return Mapping(alloc.ptr, "vmm", local_device, alloc.free)


class FdServer:
    """Hands VMM file descriptors to local peers that present a nonce issued by :meth:`grant`.

    Listens on an abstract Unix socket (no file to clean up); nonces are single use and expire
    after ``ttl`` seconds, and at most ``_MAX_GRANTS`` are outstanding (the oldest goes first). A
    connection must deliver its nonce within ``_NONCE_WAIT_S``, so a silent local process holds
    the server up briefly at most; running out of descriptors pauses accepting, never ends it.
    """

    def __init__(self, ttl: float) -> None:
        self._ttl = ttl
        self._grants: dict[bytes, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self.address = f"\0mori-io-nvlink-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="mori-io-nvlink-fds", daemon=True)
        self._thread.start()

    def grant(self, fd: int) -> bytes:
        """A nonce that fetches a duplicate of ``fd`` once (``fd`` must stay open until then)."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        now = time.monotonic()
        with self._lock:
            for n in [n for n, (_, t) in self._grants.items() if t < now]:
                del self._grants[n]
            while len(self._grants) >= _MAX_GRANTS:
                del self._grants[next(iter(self._grants))]
            self._grants[nonce] = (fd, now + self._ttl)
        return nonce

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)  # out of descriptors: back off, then accept again
                continue
            with conn:
                try:
                    conn.settimeout(min(self._ttl, _NONCE_WAIT_S))
                    nonce = conn.recv(_NONCE_BYTES, socket.MSG_WAITALL)
                    with self._lock:
                        fd, expiry = self._grants.pop(nonce, (-1, 0.0))
                    if fd < 0 or expiry < time.monotonic():
                        continue  # unknown or stale nonce: the peer sees the connection close
                    send_fds(conn, [fd], timeout=self._ttl)
                except (OSError, ValueError):
                    continue

    def close(self) -> None:
        """Stops serving."""
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)


def fetch_fd(address: str, nonce: bytes, timeout: float) -> int:
    """Fetches the fd granted for ``nonce`` from the :class:`FdServer` at ``address``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.sendall(nonce)
        try:
            _, fds = recv_fds(sock, timeout=timeout)
        except ConnectionError:
            raise ConnectionError("the memory owner refused the VMM handle (nonce unknown or expired)") from None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ConnectionError(f"expected one VMM handle, received {len(fds)}")
    return fds[0]
