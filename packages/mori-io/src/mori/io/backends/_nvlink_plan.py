"""How the NVLink backend splits a batch between the gather kernel and the copy engines.

Pure array arithmetic (no CUDA), so it is tested on any machine:

1. blocks of zero bytes are dropped; runs of blocks that are contiguous on both sides (the next
   block starts where the previous ended, locally and remotely) merge into one block. A
   scattered batch of equal blocks of ``KERNEL_PIECE`` bytes up to ``kernel_max`` skips this and
   step 3: it goes to the kernel as it is;
2. blocks smaller than ``kernel_max`` bytes go to one launch of the gather kernel, which cuts
   each row into ``kernel_per_row`` pieces of ``KERNEL_PIECE`` bytes (a warp copies one piece,
   and many pieces keep all warps busy). Rows of about one size (the KV-cache case) are cut only
   there; when sizes differ so much that most pieces of the longest row's count would be empty,
   the host cuts the rows instead (``kernel_per_row`` = 1). A lone kernel block needs no table:
   the kernel cuts it itself. The rest go to the copy engines;
3. copy-engine blocks larger than ``stripe`` bytes are cut into ``stripe``-sized pieces and all
   pieces are dealt out over at most ``max_streams`` streams, balancing bytes, so several copy
   engines work at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CopyPlan", "plan_copies", "KERNEL_PIECE"]

KERNEL_PIECE = 32 << 10


@dataclass
class CopyPlan:
    """``kernel``: (k, 3) uint64 rows (src, dst, bytes) for the gather kernel, each cut there into
    ``kernel_per_row`` pieces of ``KERNEL_PIECE`` bytes; ``engines``: one (m, 3) array of rows
    per copy-engine stream."""

    kernel: np.ndarray
    engines: list[np.ndarray] = field(default_factory=list)
    kernel_per_row: int = 1

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return int(self.kernel[:, 2].sum()) + sum(int(e[:, 2].sum()) for e in self.engines)


def _merge(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Every pass over a 16k-block batch costs microseconds: boolean indexing only where something
    # is dropped, and one reduction to learn that nothing is.
    if not sizes.all():
        keep = sizes != 0
        src, dst, sizes = src[keep], dst[keep], sizes[keep]
    if len(sizes) < 2:
        return src, dst, sizes
    joins = src[1:] == src[:-1] + sizes[:-1]
    joins &= dst[1:] == dst[:-1] + sizes[:-1]
    if not joins.any():
        return src, dst, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return src[starts], dst[starts], np.add.reduceat(sizes, starts)


def _stripe(rows: np.ndarray, stripe: int) -> np.ndarray:
    """Cuts rows larger than ``stripe`` bytes into pieces of at most ``stripe`` bytes."""
    sizes = rows[:, 2]
    if int(sizes.max(initial=0)) <= stripe:
        return rows
    pieces = (sizes + np.uint64(stripe - 1)) // np.uint64(stripe)
    idx = np.repeat(np.arange(len(rows)), pieces.astype(np.int64))
    first = np.concatenate(([0], np.cumsum(pieces.astype(np.int64))[:-1]))
    k = (np.arange(len(idx)) - np.repeat(first, pieces.astype(np.int64))).astype(np.uint64)
    off = k * np.uint64(stripe)
    out = np.empty((len(idx), 3), dtype=np.uint64)
    out[:, 0] = rows[idx, 0] + off
    out[:, 1] = rows[idx, 1] + off
    out[:, 2] = np.minimum(sizes[idx] - off, np.uint64(stripe))
    return out


def _deal(rows: np.ndarray, max_streams: int, stripe: int) -> list[np.ndarray]:
    if len(rows) == 0:
        return []
    total = int(rows[:, 2].sum())
    n = max(1, min(max_streams, len(rows), -(-total // stripe)))
    if n == 1:
        return [rows]
    # Cut the byte-ordered sequence into n runs of about total/n bytes each.
    cum = np.cumsum(rows[:, 2]) - rows[:, 2]
    lane = np.minimum((cum * np.uint64(n)) // np.uint64(total), np.uint64(n - 1)).astype(np.int64)
    return [rows[lane == i] for i in range(n) if (lane == i).any()]


Offsets = Sequence[int] | np.ndarray


def _single(src: int, dst: int, size: int, kernel_max: int, stripe: int, max_streams: int) -> CopyPlan:
    """The plan of one block, without array passes (the latency path of a one-block transfer)."""
    row = np.array([[src, dst, size]], dtype=np.uint64)
    if size == 0:
        return CopyPlan(row[:0])
    if size < kernel_max:
        return CopyPlan(row)
    return CopyPlan(row[:0], _deal(_stripe(row, stripe), max_streams, stripe))


def _uniform_kernel_rows(src_base: int, dst_base: int, src: np.ndarray, dst: np.ndarray, sz: np.ndarray,
                         kernel_max: int) -> CopyPlan | None:
    """The plan of a scattered batch of equal blocks of KERNEL_PIECE..kernel_max bytes (the
    KV-cache case; ``src``/``dst`` are int64 offsets from the bases), or None. Such blocks go to
    the kernel as they are: each gives every warp it gets a whole piece, so merging contiguous
    runs would not make the kernel faster, and skipping the merge and split passes keeps the
    host's share of a 256 MiB batch to a few microseconds.
    A batch whose first two blocks are contiguous takes the general path (its merged runs may
    be large enough for the copy engines); either way every block is copied."""
    if len(sz) < 2:
        return None
    size = int(sz[0])
    if not KERNEL_PIECE <= size < kernel_max or int(sz.min()) != int(sz.max()):
        return None
    if src[1] == src[0] + size and dst[1] == dst[0] + size:
        return None  # likely contiguous: merged, it may be one copy-engine copy, faster than the kernel
    rows = np.empty((len(sz), 3), dtype=np.int64)
    np.add(src, src_base, out=rows[:, 0])
    np.add(dst, dst_base, out=rows[:, 1])
    rows[:, 2] = size
    return CopyPlan(rows.view(np.uint64), [], -(-size // KERNEL_PIECE))


def plan_copies(src_base: int, dst_base: int, src_offsets: Offsets, dst_offsets: Offsets, sizes: Offsets,
                kernel_max: int, stripe: int, max_streams: int) -> CopyPlan:
    """Plans copies of ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base +
    dst_offsets[i]`` (offsets already checked against both regions)."""
    if kernel_max < 0 or stripe <= 0 or max_streams <= 0:
        raise ValueError(f"plan_copies: kernel_max={kernel_max}, stripe={stripe}, max_streams={max_streams}")
    if len(sizes) == 1:
        return _single(src_base + int(src_offsets[0]), dst_base + int(dst_offsets[0]), int(sizes[0]), kernel_max,
                       stripe, max_streams)
    # int64 arithmetic (addresses are below 2**63): numpy int64 offsets from the engine are used
    # without a conversion copy; the rows are reinterpreted as uint64 at the end.
    sz = np.asarray(sizes, dtype=np.int64)
    src_offs, dst_offs = np.asarray(src_offsets, dtype=np.int64), np.asarray(dst_offsets, dtype=np.int64)
    uniform = _uniform_kernel_rows(src_base, dst_base, src_offs, dst_offs, sz, kernel_max)
    if uniform is not None:
        return uniform
    src, dst, sz = _merge(src_offs + src_base, dst_offs + dst_base, sz)
    rows = np.stack((src, dst, sz), axis=1).view(np.uint64)
    if len(sz) == 0 or int(sz.max()) < kernel_max:
        kernel_rows, engine_rows = rows, rows[:0]
    elif int(sz.min()) >= kernel_max:
        kernel_rows, engine_rows = rows[:0], rows
    else:
        small = sz < kernel_max
        kernel_rows, engine_rows = rows[small], rows[~small]
    per_row = 1
    if len(kernel_rows) > 1:
        per_row = -(-int(kernel_rows[:, 2].max()) // KERNEL_PIECE)
        if per_row > 1:
            pieces = int(((kernel_rows[:, 2] + np.uint64(KERNEL_PIECE - 1)) // np.uint64(KERNEL_PIECE)).sum())
            if per_row * len(kernel_rows) > 2 * pieces:  # mostly empty pieces: cut here instead
                kernel_rows, per_row = _stripe(kernel_rows, KERNEL_PIECE), 1
    return CopyPlan(np.ascontiguousarray(kernel_rows), _deal(_stripe(engine_rows, stripe), max_streams, stripe),
                    per_row)
