"""The symmetric-heap allocator: pure bookkeeping of offsets, no memory touched.

Every PE runs the same deterministic allocator over a heap of the same size, so the same sequence
of ``malloc``/``free`` calls gives the same offsets everywhere: that is what makes an address
"symmetric". The first :data:`INTERNAL_BYTES` of the heap belong to mori (barrier slots, device
state) and are never handed out. Free space is kept as a sorted list of disjoint ranges that are
merged with their neighbours on ``free``, so fragmentation from interleaved frees heals itself.
"""

from __future__ import annotations

import bisect
import hashlib

from mori.core.memory import LiveRanges

__all__ = ["INTERNAL_BYTES", "MIN_ALIGNMENT", "ShmemOutOfMemoryError", "SymmetricAllocator"]

#: Bytes at the start of every heap reserved for mori's own use (mirrors ``kInternalBytes``).
INTERNAL_BYTES = 64 * 1024
#: Alignment of every block unless a larger power of two is asked for; also the size granule.
MIN_ALIGNMENT = 256


class ShmemOutOfMemoryError(MemoryError):
    """The symmetric heap has no free range large enough for a request."""


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _block_hash(offset: int, size: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{offset}:{size}".encode(), digest_size=8).digest(), "little")


def _round_up(value: int, granule: int) -> int:
    return (value + granule - 1) // granule * granule


class SymmetricAllocator:
    """First-fit allocator over ``[reserved, heap_size)`` with coalescing free ranges.

    Offsets are relative to the heap base. Block sizes are rounded up to :data:`MIN_ALIGNMENT`;
    ``max_alignment`` is the largest alignment a request may ask for.
    """

    def __init__(self, heap_size: int, reserved: int = INTERNAL_BYTES, max_alignment: int = 1 << 30) -> None:
        if not isinstance(heap_size, int) or not isinstance(reserved, int):
            raise TypeError("heap_size and reserved must be int")
        if reserved < 0 or reserved % MIN_ALIGNMENT:
            raise ValueError(f"reserved={reserved} must be a non-negative multiple of {MIN_ALIGNMENT}")
        if heap_size <= reserved:
            raise ValueError(f"heap size {heap_size} bytes leaves nothing after the {reserved}-byte internal area")
        self.heap_size = heap_size
        self.reserved = reserved
        # Offsets are aligned relative to the heap base, so an address is only as aligned as every
        # PE's base: larger alignments cannot be symmetric and are refused.
        self.max_alignment = max_alignment
        # Disjoint, non-adjacent free ranges [start, end), sorted by start.
        self._free_starts: list[int] = [reserved]
        self._free_ends: list[int] = [heap_size]
        self._blocks: dict[int, int] = {}  # start -> end of every live block
        # start -> the size the caller asked for (before rounding): where a put may write. Native,
        # so that a remote put checks against it in the call that moves its bytes (mori.core.ucx.UcxHeapWindow).
        self.live = LiveRanges()
        self._in_use = 0
        # An order-free digest of the live blocks (XOR of each block's hash): equal on every PE
        # exactly when their live blocks, hence their free ranges and later offsets, are equal.
        self._layout = 0

    @property
    def in_use(self) -> int:
        """Bytes held by live blocks (after rounding to the size granule)."""
        return self._in_use

    @property
    def high_water(self) -> int:
        """One past the highest byte any live block covers (``reserved`` when none is live)."""
        return max(self._blocks.values(), default=self.reserved)

    def largest_free(self) -> int:
        """Size of the largest free range."""
        return max((e - s for s, e in zip(self._free_starts, self._free_ends)), default=0)

    def malloc(self, size: int, alignment: int = MIN_ALIGNMENT) -> int:
        """Reserves ``size`` bytes aligned to ``alignment`` (a power of two); returns the offset."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"allocation size must be a positive int, got {size!r}")
        if not isinstance(alignment, int) or not _is_power_of_two(alignment):
            raise ValueError(f"alignment must be a power of two, got {alignment!r}")
        if alignment > self.max_alignment:
            raise ValueError(
                f"alignment {alignment} exceeds {self.max_alignment}, the alignment of every PE's heap base"
            )
        alignment = max(alignment, MIN_ALIGNMENT)
        need = _round_up(size, MIN_ALIGNMENT)
        for i, (start, end) in enumerate(zip(self._free_starts, self._free_ends)):
            offset = _round_up(start, alignment)
            if offset + need <= end:
                self._take(i, offset, offset + need)
                self.live.add(offset, size)
                self._layout ^= _block_hash(offset, size)
                return offset
        raise ShmemOutOfMemoryError(
            f"symmetric heap exhausted: requested {size} bytes (alignment {alignment}); heap size "
            f"{self.heap_size} bytes, in use {self._in_use} bytes, internal area {self.reserved} bytes, "
            f"largest free range {self.largest_free()} bytes (raise MORI_SHMEM_HEAP_SIZE)"
        )

    def _take(self, i: int, lo: int, hi: int) -> None:
        start, end = self._free_starts[i], self._free_ends[i]
        del self._free_starts[i], self._free_ends[i]
        # Put back what is left on either side of the block, in order.
        for s, e in ((hi, end), (start, lo)):
            if s < e:
                self._free_starts.insert(i, s)
                self._free_ends.insert(i, e)
        self._blocks[lo] = hi
        self._in_use += hi - lo

    def free(self, offset: int) -> int:
        """Releases the block starting at ``offset``; returns its size. Unknown offsets raise."""
        end = self._blocks.pop(offset, None)
        if end is None:
            raise ValueError(f"offset {offset:#x} is not the start of a live symmetric allocation")
        asked = self.live.remove(offset)
        assert asked is not None, "a live block without its asked size"
        self._layout ^= _block_hash(offset, asked)
        self._in_use -= end - offset
        i = bisect.bisect_left(self._free_starts, offset)
        start = offset
        # Merge with the free range just before and the one just after, when they touch.
        if i > 0 and self._free_ends[i - 1] == offset:
            i -= 1
            start = self._free_starts[i]
            del self._free_starts[i], self._free_ends[i]
        if i < len(self._free_starts) and self._free_starts[i] == end:
            end = self._free_ends[i]
            del self._free_starts[i], self._free_ends[i]
        self._free_starts.insert(i, start)
        self._free_ends.insert(i, end)
        return end - offset

    def layout(self) -> str:
        """A digest of the live blocks (offsets and sizes asked for), for comparing PEs."""
        return f"{len(self._blocks)} blocks, {self._in_use} bytes, digest {self._layout:016x}"

    def block_of(self, offset: int, nbytes: int) -> tuple[int, int] | None:
        """``(start, requested size)`` of the live block holding ``[offset, offset + nbytes)``
        whole, or None when no single block does."""
        return self.live.find(offset, nbytes)

    def blocks(self) -> dict[int, int]:
        """A copy of the live blocks, ``start -> end``."""
        return dict(self._blocks)

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges ``(start, end)`` in address order."""
        return list(zip(self._free_starts, self._free_ends))
