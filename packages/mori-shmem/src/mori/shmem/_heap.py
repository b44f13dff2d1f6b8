"""The symmetric heap of one PE: its memory, its peers' mappings, and byte-level access to both.

A heap is one region per PE (GPU: CUDA VMM memory, :mod:`._heap_gpu`; CPU: a host shared-memory
segment, :mod:`._heap_cpu`), exported as file descriptors and mapped by every PE of the host, so a
peer's copy of symmetric address ``a`` is ``peer_bases[pe] + (a - base)``. The first
:data:`INTERNAL_BYTES` hold mori's own data; :data:`PEER_BASES_OFFSET` is where the
``uint64_t[world]`` array that ``GpuStates.peerHeapBases`` points to lives.
"""

from __future__ import annotations

import abc
import ctypes
from collections.abc import Callable
from typing import Any

from mori.core.codes import Cmp

from ._allocator import INTERNAL_BYTES

__all__ = ["BARRIER_SLOTS_OFFSET", "Heap", "INTERNAL_BYTES", "PEER_BASES_OFFSET", "RESULT_OFFSET"]

#: Internal-area layout shared with the device headers: [0, 8) barrier epoch, [64, 64 + 8*kMaxPes)
#: barrier arrival slots, [4096, ...) device scratch. mori.shmem adds:
BARRIER_SLOTS_OFFSET = 64
#: ``uint64_t peerHeapBases[world]`` as seen by this PE (what ``GpuStates.peerHeapBases`` points to).
PEER_BASES_OFFSET = 8192
#: 8-byte slot where host-initiated GPU atomics leave the old value. The rest of the internal area
#: is spare (the remote transport stages through its heap window's own host memory).
RESULT_OFFSET = 12288


class Heap(abc.ABC):
    """One PE's symmetric heap and its mappings of every reachable peer's heap.

    ``base``/``size``: the local heap; ``peer_bases[pe]``: where PE ``pe``'s heap is mapped in
    this process (0 when not reachable; own entry = ``base``); ``chunk``: the bytes mapped at a
    time (the whole heap when it is mapped at once); ``mapped``: the bytes mapped so far, from
    offset 0; ``on_grow``: called with the new ``mapped`` after the heap grew (collective).
    """

    kind: str
    base: int
    size: int
    chunk: int
    mapped: int
    peer_bases: list[int]
    p2p_disabled: bool
    on_grow: Callable[[int], None] | None = None

    def ensure_mapped(self, end: int) -> None:  # noqa: B027 - static heaps are mapped whole
        """Makes ``[0, end)`` of every heap usable. Collective where mapping grows (vmm mode)."""

    @abc.abstractmethod
    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copies ``nbytes`` between two addresses this process can reach; complete on return."""

    @abc.abstractmethod
    def atomic(self, op: str, pe: int, offset: int, value: int, compare: int, width: int) -> int:
        """Performs ``op`` (fetch_add, compare_swap, swap, store) on PE ``pe``'s heap at ``offset``.

        Returns the old value. Bounds and reachability are checked by the caller.
        """

    @abc.abstractmethod
    def wait_until(self, offset: int, cmp: Cmp, value: int, timeout: float, width: int, stores: Any = None) -> int:
        """Waits until this PE's word at ``offset`` compares ``cmp`` to ``value``; returns it.

        ``stores``: the remote transport's log of its writes into the heap (``RemoteTransport.stores``),
        for a heap that would otherwise see them late. Raises TimeoutError naming the address,
        condition and last value after ``timeout`` s.
        """

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Completes every operation issued by this process on the heap (quiet)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unmaps the peers and releases the local heap."""

    def write(self, addr: int, data: bytes) -> None:
        """Writes host bytes to ``addr``."""
        buf = ctypes.create_string_buffer(data, len(data))
        self.copy(addr, ctypes.addressof(buf), len(data))

    def read(self, addr: int, nbytes: int) -> bytes:
        """Reads ``nbytes`` from ``addr`` into host bytes."""
        buf = ctypes.create_string_buffer(nbytes)
        self.copy(ctypes.addressof(buf), addr, nbytes)
        return buf.raw

    def publish_peer_bases(self) -> None:
        """Writes ``peer_bases`` into the internal area for the device state to point at."""
        self.write(self.base + PEER_BASES_OFFSET, b"".join(b.to_bytes(8, "little") for b in self.peer_bases))

    def describe(self) -> dict[str, Any]:
        """A summary for logs."""
        return {
            "kind": self.kind,
            "base": hex(self.base),
            "size": self.size,
            "reachable": [pe for pe, b in enumerate(self.peer_bases) if b],
        }


assert PEER_BASES_OFFSET + 8 * 64 <= RESULT_OFFSET < RESULT_OFFSET + 8 <= INTERNAL_BYTES
