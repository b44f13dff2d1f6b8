"""Space in a buffer or a file, handed out in aligned extents: the DRAM tier's slots and the SSD
tier's records."""

from __future__ import annotations

import bisect

#: The unit of every extent: a page, so that a DRAM slot and an SSD record are aligned for direct
#: I/O (``O_DIRECT`` wants the address, offset and length aligned to the device's block).
ALIGN = 4096


def aligned(size: int) -> int:
    """``size`` rounded up to :data:`ALIGN`."""
    return (size + ALIGN - 1) // ALIGN * ALIGN


class ExtentAllocator:
    """First-fit allocation of aligned extents in ``[0, capacity)``, with freed extents merged
    with their free neighbours. Not thread-safe: its owner holds a lock. The free extents are
    kept sorted by offset; allocation is linear in their number, which stays small while the
    slots are of a few sizes (a KV pool's pages are)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"capacity must be a positive multiple of {ALIGN}, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]
        self._lengths: list[int] = [capacity]
        self.used = 0

    def allocate(self, size: int) -> int | None:
        """The offset of a free extent of ``aligned(size)`` bytes, now taken; None when no free
        extent is that large."""
        need = aligned(size)
        for i, length in enumerate(self._lengths):
            if length >= need:
                offset = self._starts[i]
                if length == need:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += need
                    self._lengths[i] -= need
                self.used += need
                return offset
        return None

    def free(self, offset: int, size: int) -> None:
        """Returns ``[offset, offset + aligned(size))``, taken earlier, to the free extents."""
        length = aligned(size)
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < offset + length) or (
            i > 0 and self._starts[i - 1] + self._lengths[i - 1] > offset
        ):
            raise ValueError(f"extent [{offset}, {offset + length}) is already free")
        merge_left = i > 0 and self._starts[i - 1] + self._lengths[i - 1] == offset
        merge_right = i < len(self._starts) and offset + length == self._starts[i]
        if merge_left and merge_right:
            self._lengths[i - 1] += length + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_left:
            self._lengths[i - 1] += length
        elif merge_right:
            self._starts[i] = offset
            self._lengths[i] += length
        else:
            self._starts.insert(i, offset)
            self._lengths.insert(i, length)
        self.used -= length

    def largest_free(self) -> int:
        """The longest free extent, in bytes."""
        return max(self._lengths, default=0)
