"""Host buffers for KV pages: MORI's ``UMBPHostMemAllocator`` (SGLang's host KV pool allocates
through it) and the DRAM tier's own buffer, both ``mmap`` mappings."""

from __future__ import annotations

import mmap
import os
import threading

from mori.core.log import get_logger
from mori.core.memory import buffer_span

from ._enums import UMBPHostBufferBacking

_log = get_logger("umbp")
# Linux's MAP_HUGETLB and MFD_HUGETLB; Python's mmap module names the first only from 3.12 on.
_MAP_HUGETLB = getattr(mmap, "MAP_HUGETLB", 0x40000)
_MFD_HUGETLB = getattr(os, "MFD_HUGETLB", 0x4)
_HUGE_SHIFT = 26  # MAP_HUGE_SHIFT / MFD_HUGE_SHIFT: log2 of the huge page size goes above it


#: Live buffers with a shared backing, by address: what a standalone client hands its server.
_SHARED: dict[int, UMBPHostBufferHandle] = {}
_SHARED_LOCK = threading.Lock()


def shared_buffer_of(ptr: int, size: int) -> UMBPHostBufferHandle | None:
    """The live shared-backing buffer (``AnonymousShm*``) that holds ``[ptr, ptr + size)``."""
    with _SHARED_LOCK:
        for base, handle in _SHARED.items():
            if base <= ptr and ptr + size <= base + handle.mapped_size:
                return handle
    return None


def _round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


class UMBPHostBufferHandle:
    """One buffer from :meth:`UMBPHostMemAllocator.alloc`: ``ptr`` (0 when the allocation
    failed, and then the handle is false), the size asked for and the size mapped, the backing
    the kernel gave and its alignment."""

    __slots__ = ("_map", "_fd", "ptr", "requested_size", "mapped_size", "actual_backing", "actual_alignment")

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._fd = -1
        self.ptr = 0
        self.requested_size = 0
        self.mapped_size = 0
        self.actual_backing = UMBPHostBufferBacking.Anonymous
        self.actual_alignment = 0

    def __bool__(self) -> bool:
        return self.ptr != 0

    def __repr__(self) -> str:
        return (
            f"<UMBPHostBufferHandle ptr=0x{self.ptr:x} requested_size={self.requested_size} "
            f"mapped_size={self.mapped_size}>"
        )

    @property
    def fd(self) -> int:
        """The ``memfd`` behind a shared backing (``AnonymousShm*``), else -1: what a process on
        this host maps to see the same pages."""
        return self._fd

    def view(self) -> memoryview:
        """The buffer's bytes (valid until the handle is freed)."""
        if self._map is None:
            raise ValueError("the handle holds no buffer (freed, or its allocation failed)")
        return memoryview(self._map)


def _map(
    size: int, backing: UMBPHostBufferBacking, hugepage_size: int, prefault: bool, name: str
) -> tuple[mmap.mmap, int]:
    """One mapping of ``size`` bytes with exactly ``backing``, or OSError."""
    huge = backing in (UMBPHostBufferBacking.AnonymousHugetlb, UMBPHostBufferBacking.AnonymousShmHugetlb)
    huge_bits = _MAP_HUGETLB | (hugepage_size.bit_length() - 1) << _HUGE_SHIFT if huge else 0
    populate = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
    if backing in (UMBPHostBufferBacking.Anonymous, UMBPHostBufferBacking.AnonymousHugetlb):
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | huge_bits | populate
        return mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE), -1
    mfd_flags = os.MFD_CLOEXEC | ((_MFD_HUGETLB | (hugepage_size.bit_length() - 1) << _HUGE_SHIFT) if huge else 0)
    fd = os.memfd_create(name, mfd_flags)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE), fd
    except BaseException:
        os.close(fd)
        raise


def allocate_host_buffer(
    size: int,
    backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
    hugepage_size: int = 2 << 20,
    prefault: bool = True,
    name: str = "umbp",
) -> UMBPHostBufferHandle:
    """A host buffer of at least ``size`` bytes. A huge-page backing the kernel cannot give
    falls back to the same backing on ordinary pages (the handle says which it got); a failed
    mapping gives an empty handle."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"size must be a positive int, got {size!r}")
    if not isinstance(backing, UMBPHostBufferBacking):
        raise TypeError(f"backing must be a UMBPHostBufferBacking, not {type(backing).__name__}")
    if (
        isinstance(hugepage_size, bool)
        or not isinstance(hugepage_size, int)
        or hugepage_size <= 0
        or hugepage_size & (hugepage_size - 1)
    ):
        raise ValueError(f"hugepage_size must be a power of two, got {hugepage_size!r}")
    tries = [backing]
    if backing == UMBPHostBufferBacking.AnonymousHugetlb:
        tries.append(UMBPHostBufferBacking.Anonymous)
    elif backing == UMBPHostBufferBacking.AnonymousShmHugetlb:
        tries.append(UMBPHostBufferBacking.AnonymousShm)
    handle = UMBPHostBufferHandle()
    for got in tries:
        huge = got in (UMBPHostBufferBacking.AnonymousHugetlb, UMBPHostBufferBacking.AnonymousShmHugetlb)
        align = hugepage_size if huge else mmap.PAGESIZE
        mapped = _round_up(size, align)
        try:
            handle._map, handle._fd = _map(mapped, got, hugepage_size, prefault, name)
        except OSError as exc:
            _log.info("host buffer of %d bytes with %s backing failed (%s)", mapped, got.name, exc)
            continue
        handle.ptr = buffer_span(handle._map)[0]
        handle.requested_size, handle.mapped_size = size, mapped
        handle.actual_backing, handle.actual_alignment = got, align
        if handle._fd >= 0:
            with _SHARED_LOCK:
                _SHARED[handle.ptr] = handle
        if got != backing:
            _log.warning(
                "asked for %s host memory, got %s (no free huge pages of %d bytes?)",
                backing.name,
                got.name,
                hugepage_size,
            )
        break
    return handle


def free_host_buffer(handle: UMBPHostBufferHandle) -> None:
    """Unmaps the handle's buffer (once; an empty or freed handle is left as it is)."""
    with _SHARED_LOCK:
        if _SHARED.get(handle.ptr) is handle:
            del _SHARED[handle.ptr]
    if handle._map is not None:
        try:
            handle._map.close()
        except BufferError:  # a view of it is still alive: leave it mapped rather than crash a reader
            _log.warning("host buffer at 0x%x still has views; left mapped", handle.ptr)
            return
        handle._map = None
    if handle._fd >= 0:
        os.close(handle._fd)
        handle._fd = -1
    handle.ptr = 0


class UMBPHostMemAllocator:
    """MORI's host-memory allocator: page-aligned ``mmap`` buffers, on huge pages where asked and
    available. SGLang's ``UMBPHostTensorAllocator`` puts the host KV pool in one."""

    def alloc(
        self,
        size: int,
        backing: UMBPHostBufferBacking = UMBPHostBufferBacking.Anonymous,
        hugepage_size: int = 2 << 20,
        numa_node: int = -1,
        prefault: bool = True,
    ) -> UMBPHostBufferHandle:
        """A buffer of at least ``size`` bytes; an empty (false) handle when the system has no
        memory for it. ``numa_node`` is accepted for MORI's callers and not bound here."""
        if isinstance(numa_node, bool) or not isinstance(numa_node, int) or numa_node < -1:
            raise ValueError(f"numa_node must be an int >= -1, got {numa_node!r}")
        return allocate_host_buffer(size, backing, hugepage_size, prefault)

    def free(self, handle: UMBPHostBufferHandle) -> None:
        """Releases a buffer from :meth:`alloc`; freeing it again does nothing."""
        if not isinstance(handle, UMBPHostBufferHandle):
            raise TypeError(f"handle must be a UMBPHostBufferHandle, not {type(handle).__name__}")
        free_host_buffer(handle)
