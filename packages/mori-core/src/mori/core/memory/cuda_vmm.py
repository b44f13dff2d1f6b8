"""GPU memory through the CUDA virtual memory management (VMM) API, shareable as POSIX fds.

An allocation is physical memory (``cuMemCreate`` with the POSIX file-descriptor handle type)
mapped at a reserved virtual range with read/write access for its device and any listed peer
devices. ``export_fd()`` gives a descriptor another process receives over a Unix socket
(:func:`mori.core.memory.send_fds`) and maps with :meth:`VmmAllocation.import_fd`: over NVLink
the importer's loads and stores reach the exporter's GPU memory directly.

A :class:`VmmReservation` is a fixed virtual range that grows by chunks mapped at offsets, its
own (:meth:`~VmmReservation.create_chunk`) or a peer's (:meth:`~VmmReservation.import_chunk`):
the base address never moves, so pointers handed out before a growth stay valid (the symmetric
heap of mori.shmem is one reservation per PE).

Needs the ``mori-core[cuda]`` extra (``cuda-bindings``); importing this module does not, and
every call without it raises :class:`mori.core.cuda.CudaUnavailableError` saying what to
install. Multicast objects are deliberately never created here.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

from .. import cuda as _cuda
from ._fdpass import check_fd

__all__ = ["VmmAllocation", "VmmReservation", "export_allocation_fd", "granularity"]


def _prop(device: int) -> Any:
    drv = _cuda.driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _fd_handle_type() -> Any:
    return _cuda.driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _export(handle: Any) -> int:
    fd = int(_cuda.call("cuMemExportToShareableHandle", handle, _fd_handle_type(), 0))
    os.set_inheritable(fd, False)
    return fd


def export_allocation_fd(ptr: int) -> int:
    """A new file descriptor for the VMM allocation that holds address ``ptr`` in this process,
    whoever made it (``cuMemCreate`` with the POSIX-fd handle type, mapped here); the caller owns
    it. The allocation's handle is retained for the export and released after it, failed or not.
    Raises :class:`mori.core.cuda.CudaError` when ``ptr`` is not in such an allocation.
    """
    handle = _cuda.call("cuMemRetainAllocationHandle", ptr, detail=f"pointer 0x{ptr:x}")
    try:
        return _export(handle)
    finally:
        _cuda.call("cuMemRelease", handle)


def granularity(device: int, recommended: bool = False) -> int:
    """The granularity (bytes) of VMM allocations on ``device``: sizes round up to it.

    ``recommended=True`` gives the driver's recommended granularity (for performance) instead of
    the minimum. Makes ``device``'s primary context current.
    """
    _cuda.init_device(device)
    flags = _cuda.driver().CUmemAllocationGranularity_flags
    flag = flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended else flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(_cuda.call("cuMemGetAllocationGranularity", _prop(device), flag, detail=f"device {device}"))


def _rounded(size: int, device: int) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"VMM allocation size must be an int > 0 bytes, got {size!r}")
    gran = granularity(device)
    return -(-size // gran) * gran


def _access(devices: Sequence[int]) -> list[Any]:
    drv = _cuda.driver()
    descs = []
    for d in devices:
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = d
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    return descs


def _check_devices(devices: Sequence[int]) -> list[int]:
    out = []
    for d in devices:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ValueError(f"peer devices must be CUDA device ordinals >= 0, got {d!r}")
        if d not in out:
            out.append(d)
    return out


class VmmAllocation:
    """GPU memory mapped in this process: ``ptr`` (device address), ``size`` (bytes), ``device``.

    Made by :meth:`create` (new memory on ``device``) or :meth:`import_fd` (a peer's memory).
    :meth:`free` unmaps and releases it; use it as a context manager to free on exit.
    """

    def __init__(self, handle: Any, ptr: int, size: int, device: int, imported: bool):
        self._handle, self.ptr, self.size, self.device, self.imported = handle, ptr, size, device, imported

    @classmethod
    def create(cls, size: int, device: int, peers: Sequence[int] = ()) -> VmmAllocation:
        """Allocates at least ``size`` bytes on ``device`` (rounded up to :func:`granularity`).

        The memory is readable and writable from ``device`` and every device in ``peers``
        (which must have peer access to it, e.g. over NVLink).
        """
        peers = _check_devices(peers)
        size = _rounded(size, device)
        handle = _cuda.call("cuMemCreate", size, _prop(device), 0, detail=f"{size} bytes on device {device}")
        return cls._map(handle, size, device, peers, imported=False)

    @classmethod
    def import_fd(cls, fd: int, size: int, device: int, peers: Sequence[int] = ()) -> VmmAllocation:
        """Maps a peer process's allocation, received as ``fd`` from its :meth:`export_fd`.

        ``size`` is the exporter's ``alloc.size``. The mapping is accessible from ``device`` (the
        one this process computes on) and ``peers``. The caller keeps ownership of ``fd``: the
        import holds its own reference to the memory, so ``fd`` may be closed right after.
        """
        check_fd(fd, "VmmAllocation.import_fd")
        peers = _check_devices(peers)
        size = _rounded(size, device)
        handle = _cuda.call("cuMemImportFromShareableHandle", fd, _fd_handle_type(), detail=f"fd {fd}")
        return cls._map(handle, size, device, peers, imported=True)

    @classmethod
    def _map(cls, handle: Any, size: int, device: int, peers: list[int], imported: bool) -> VmmAllocation:
        """Reserves, maps and grants access; on any failure undoes what was done and releases ``handle``."""
        undo: list[tuple[Any, ...]] = [("cuMemRelease", handle)]
        try:
            ptr = int(_cuda.call("cuMemAddressReserve", size, granularity(device), 0, 0, detail=f"{size} bytes"))
            undo.append(("cuMemAddressFree", ptr, size))
            _cuda.call("cuMemMap", ptr, size, 0, handle, 0, detail=f"{size} bytes at 0x{ptr:x}")
            undo.append(("cuMemUnmap", ptr, size))
            alloc = cls(handle, ptr, size, device, imported)
            alloc.set_access([device, *peers])
            return alloc
        except BaseException:
            for call, *args in reversed(undo):
                _cuda.call(call, *args)
            raise

    def set_access(self, devices: Sequence[int]) -> None:
        """Grants read/write access to the mapping from each of ``devices``."""
        self._check_live()
        devices = _check_devices(devices)
        if not devices:
            raise ValueError("set_access: name at least one device")
        descs = _access(devices)
        _cuda.call(
            "cuMemSetAccess",
            self.ptr,
            self.size,
            descs,
            len(descs),
            detail=f"devices {devices} on 0x{self.ptr:x} (+{self.size} bytes)",
        )

    def export_fd(self) -> int:
        """A new file descriptor for this allocation, to pass to another process; the caller owns it."""
        self._check_live()
        return _export(self._handle)

    def write(self, data: bytes | bytearray | memoryview, offset: int = 0) -> None:
        """Copies host bytes into the allocation at ``offset``; returns once they are in GPU memory."""
        self._check_range(offset, len(data))
        if not len(data):
            return
        src = (ctypes.c_char * len(data)).from_buffer_copy(data)
        _cuda.init_device(self.device)
        _cuda.call("cuMemcpyHtoD", self.ptr + offset, ctypes.addressof(src), len(data))
        # From pageable memory the copy may return before the DMA lands; wait, so a peer told
        # "written" afterwards really sees the bytes.
        _cuda.call("cuCtxSynchronize")

    def read(self, nbytes: int, offset: int = 0) -> bytes:
        """Copies ``nbytes`` at ``offset`` back to the host (synchronous ``cuMemcpyDtoH``)."""
        self._check_range(offset, nbytes)
        dst = (ctypes.c_char * nbytes)()
        if not nbytes:
            return b""
        _cuda.init_device(self.device)
        _cuda.call("cuMemcpyDtoH", ctypes.addressof(dst), self.ptr + offset, nbytes)
        return dst.raw

    def free(self) -> None:
        """Unmaps the range, releases the memory handle and the address range. Idempotent.

        The physical memory lives on while another process (or an exported fd) still holds it.
        """
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        _cuda.init_device(self.device)
        # Order matters: the mapping goes first, then the handle, then the address range.
        _cuda.call("cuMemUnmap", self.ptr, self.size)
        _cuda.call("cuMemRelease", handle)
        _cuda.call("cuMemAddressFree", self.ptr, self.size)

    def _check_live(self) -> None:
        if self._handle is None:
            raise ValueError("VmmAllocation has been freed")

    def _check_range(self, offset: int, nbytes: int) -> None:
        self._check_live()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside the {self.size}-byte allocation")

    def __enter__(self) -> VmmAllocation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self._handle is None else f"ptr=0x{self.ptr:x}"
        return f"VmmAllocation({state}, size={self.size}, device={self.device}, imported={self.imported})"


class VmmReservation:
    """A reserved virtual range (``base``, ``size`` bytes) backed chunk by chunk, used from ``device``.

    Chunks are mapped at ``offset`` (a multiple of ``alignment``), readable and writable from
    ``device``: :meth:`create_chunk` makes new memory on ``device`` (not zeroed), and
    :meth:`import_chunk` maps a peer's chunk from the fd its :meth:`export_chunk` gave. Offsets
    already mapped are refused. :meth:`free` unmaps every chunk, then frees the range; it is
    idempotent, and a context manager frees on exit.
    """

    def __init__(self, size: int, device: int, alignment: int) -> None:
        (device,) = _check_devices([device])
        for what, value in (("size", size), ("alignment", alignment)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"VmmReservation {what} must be an int > 0 bytes, got {value!r}")
        if size % alignment:
            raise ValueError(f"VmmReservation size {size} is not a multiple of its alignment {alignment}")
        self.size, self.device, self.alignment = size, device, alignment
        self.base = int(_cuda.call("cuMemAddressReserve", size, alignment, 0, 0, detail=f"{size} bytes"))
        self._chunks: dict[int, tuple[int, Any]] = {}  # offset -> (size, CUmemGenericAllocationHandle)

    @property
    def mapped(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of every mapped chunk, in mapping order."""
        return [(offset, size) for offset, (size, _) in self._chunks.items()]

    def create_chunk(self, offset: int, size: int) -> None:
        """Backs ``[offset, offset + size)`` with new memory on ``device`` (not zeroed)."""
        self._check_free_range(offset, size)
        handle = _cuda.call("cuMemCreate", size, _prop(self.device), 0, detail=f"{size} bytes on device {self.device}")
        self._map(offset, size, handle)

    def import_chunk(self, offset: int, size: int, fd: int) -> None:
        """Maps a peer's chunk, received as ``fd``, at ``offset``; the caller keeps ``fd``."""
        check_fd(fd, "VmmReservation.import_chunk")
        self._check_free_range(offset, size)
        handle = _cuda.call("cuMemImportFromShareableHandle", fd, _fd_handle_type(), detail=f"fd {fd}")
        self._map(offset, size, handle)

    def export_chunk(self, offset: int) -> int:
        """A new fd for the chunk mapped at ``offset``, for a peer's :meth:`import_chunk`; the caller owns it."""
        if offset not in self._chunks:
            raise ValueError(f"no chunk is mapped at offset {offset:#x} of this reservation")
        return _export(self._chunks[offset][1])

    def _check_free_range(self, offset: int, size: int) -> None:
        if self.base == 0:
            raise ValueError("VmmReservation has been freed")
        for what, value in (("offset", offset), ("size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value % self.alignment:
                raise ValueError(f"chunk {what} {value!r} is not a multiple of the alignment {self.alignment}")
        if size == 0 or offset + size > self.size:
            raise ValueError(
                f"chunk [{offset:#x}, {offset + size:#x}) is empty or past the {self.size}-byte reservation"
            )
        for start, (length, _) in self._chunks.items():
            if offset < start + length and start < offset + size:
                raise ValueError(f"chunk [{offset:#x}, {offset + size:#x}) overlaps the one mapped at {start:#x}")

    def _map(self, offset: int, size: int, handle: Any) -> None:
        """Maps ``handle`` and grants ``device`` access; on failure undoes that and releases ``handle``."""
        addr = self.base + offset
        try:
            _cuda.call("cuMemMap", addr, size, 0, handle, 0, detail=f"offset {offset:#x}")
            try:
                descs = _access([self.device])
                _cuda.call("cuMemSetAccess", addr, size, descs, 1, detail=f"device {self.device}")
            except BaseException:
                _cuda.call("cuMemUnmap", addr, size)
                raise
        except BaseException:
            _cuda.call("cuMemRelease", handle)
            raise
        self._chunks[offset] = (size, handle)

    def free(self) -> None:
        """Unmaps and releases every chunk, then frees the range. Idempotent."""
        if self.base == 0:
            return
        for offset, (size, handle) in self._chunks.items():
            _cuda.call("cuMemUnmap", self.base + offset, size)
            _cuda.call("cuMemRelease", handle)
        self._chunks.clear()
        base, self.base = self.base, 0
        _cuda.call("cuMemAddressFree", base, self.size)

    def __enter__(self) -> VmmReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        state = "freed" if self.base == 0 else f"base=0x{self.base:x}, {len(self._chunks)} chunks"
        return f"VmmReservation({state}, size={self.size}, device={self.device})"
