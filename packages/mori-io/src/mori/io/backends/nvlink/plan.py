"""How the NVLink backend splits a batch between the gather kernel and the copy engines.

No CUDA here, so it is tested on any machine:

1. the transfer's :class:`mori.core.batch.Batch` (built once by the engine: blocks of zero bytes
   dropped, runs of blocks contiguous on both sides merged into one row) is rebased in one pass
   into the caller's buffer (the pinned table the kernel will read) as rows (src, dst, bytes);
2. rows smaller than ``kernel_max`` bytes go to one launch of the gather kernel (in a large
   batch of large rows, a share of them to the copy engines beside it), which cuts
   each row into ``kernel_per_row`` pieces of ``KERNEL_PIECE`` bytes (a warp copies one piece,
   and many pieces keep all warps busy). Rows of about one size (the KV-cache case) are cut only
   there; when sizes differ so much that most pieces of the longest row's count would be empty,
   the host cuts the rows instead (``kernel_per_row`` = 1). A lone kernel block needs no table:
   the kernel cuts it itself. The rest go to the copy engines;
3. copy-engine blocks larger than ``stripe`` bytes are cut into ``stripe``-sized pieces and all
   pieces are dealt out over at most ``max_streams`` streams, balancing bytes, so several copy
   engines work at once.

Every cut, merge and deal is mori-core's batch planner (``Batch`` and its ``rebased``, ``stripe``,
``count_pieces`` and ``deal``, :mod:`mori.core.batch`); this module holds only the policy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mori.core.batch import Batch

__all__ = ["CopyPlan", "plan_batch", "plan_copies", "KERNEL_PIECE", "SHARE_MIN_ROW", "SHARE_MIN_ROWS"]

KERNEL_PIECE = 32 << 10
# The copy engines and the kernel pull over NVLink at once: measured on 2 H200s, 1024 x 256 KiB
# scattered took 735 us by the kernel alone and 717 us with 40 % of the rows on the copy
# engines. Below 128 KiB a copy-engine copy costs more than it brings.
SHARE_MIN_ROW = 128 << 10
SHARE_MIN_ROWS = 64


@dataclass
class CopyPlan:
    """``kernel``: (k, 3) uint64 rows (src, dst, bytes) for the gather kernel, each cut there into
    ``kernel_per_row`` pieces of ``KERNEL_PIECE`` bytes; ``engines``: one (m, 3) array of rows
    per copy-engine stream."""

    kernel: np.ndarray
    engines: list[np.ndarray] = field(default_factory=list)
    kernel_per_row: int = 1
    in_out: bool = False  # ``kernel`` is the start of the ``out`` array given to plan_copies

    @property
    def total_bytes(self) -> int:
        """Bytes the plan moves."""
        return int(self.kernel[:, 2].sum()) + sum(int(e[:, 2].sum()) for e in self.engines)


def _deal(rows: Batch, max_streams: int, stripe: int) -> list[np.ndarray]:
    """Rows cut at ``stripe`` bytes and dealt over at most ``max_streams`` streams in runs of about
    equal bytes, no more runs than the bytes hold stripes."""
    pieces = rows.stripe(stripe)
    table, lanes, at = np.asarray(pieces), [], 0
    for run in pieces.deal(max_streams, stripe):
        lanes.append(table[at : at + len(run)])
        at += len(run)
    return lanes


Offsets = Sequence[int] | np.ndarray


def _single(src: int, dst: int, size: int, kernel_max: int, stripe: int, max_streams: int) -> CopyPlan:
    """The plan of one block, without array passes (the latency path of a one-block transfer)."""
    row = np.array([[src, dst, size]], dtype=np.uint64)
    if size == 0:
        return CopyPlan(row[:0])
    if size < kernel_max:
        return CopyPlan(row)
    return CopyPlan(row[:0], _deal(Batch.one(src, dst, size), max_streams, stripe))


def _check(kernel_max: int, stripe: int, max_streams: int) -> None:
    if kernel_max < 0 or stripe <= 0 or max_streams <= 0:
        raise ValueError(f"plan_copies: kernel_max={kernel_max}, stripe={stripe}, max_streams={max_streams}")


def plan_copies(
    src_base: int,
    dst_base: int,
    src_offsets: Offsets,
    dst_offsets: Offsets,
    sizes: Offsets,
    kernel_max: int,
    stripe: int,
    max_streams: int,
    out: np.ndarray | None = None,
    engine_share: float = 0.0,
) -> CopyPlan:
    """Plans copies of ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base +
    dst_offsets[i]`` (offsets already checked against both regions). ``out``, a (capacity >=
    len(sizes), 3) uint64 array, receives the rows; when the kernel's rows are its first ones,
    the plan's kernel rows are a view of it (``CopyPlan.in_out``). ``engine_share``: of a batch
    the kernel would take whole, the fraction of rows the copy engines take beside it (rows of
    ``SHARE_MIN_ROW`` bytes or more, batches of ``SHARE_MIN_ROWS`` rows or more)."""
    _check(kernel_max, stripe, max_streams)
    if len(sizes) == 1:
        return _single(
            src_base + int(src_offsets[0]),
            dst_base + int(dst_offsets[0]),
            int(sizes[0]),
            kernel_max,
            stripe,
            max_streams,
        )
    given = out is not None
    if out is None:
        out = np.empty((len(sizes), 3), dtype=np.uint64)
    batch = Batch(src_offsets, dst_offsets, sizes, src_base, dst_base, out)  # rows written into out
    return _plan(batch, out, given, kernel_max, stripe, max_streams, engine_share)


def plan_batch(
    batch: Batch,
    remote_base: int,
    read: bool,
    kernel_max: int,
    stripe: int,
    max_streams: int,
    out: np.ndarray | None = None,
    engine_share: float = 0.0,
) -> CopyPlan:
    """:func:`plan_copies` of a transfer's rows (local address, remote offset, bytes), the remote
    region mapped at ``remote_base``; ``read`` copies remote -> local. The rows are rebased into
    ``out`` in one pass (they are merged already); a one-row batch is read without an array
    (the latency path)."""
    _check(kernel_max, stripe, max_streams)
    if len(batch) == 1:
        local, remote, size = batch[0]
        if read:
            return _single(remote_base + remote, local, size, kernel_max, stripe, max_streams)
        return _single(local, remote_base + remote, size, kernel_max, stripe, max_streams)
    given = out is not None
    if out is None:
        out = np.empty((len(batch), 3), dtype=np.uint64)
    # Copies run src -> dst: a read's rows swapped (remote first), the remote side moved to its mapping.
    rows = batch.rebased(remote_base, 0, True, out) if read else batch.rebased(0, remote_base, False, out)
    return _plan(rows, out, given, kernel_max, stripe, max_streams, engine_share)


def _plan(
    batch: Batch, out: np.ndarray, given: bool, kernel_max: int, stripe: int, max_streams: int, engine_share: float
) -> CopyPlan:
    """The plan of ``batch``, whose rows lie at the start of ``out`` (``given``: the caller's table)."""
    n = len(batch)
    rows = out[:n]
    if batch.largest < kernel_max:
        shared = int(n * engine_share) if n >= SHARE_MIN_ROWS and batch.smallest >= SHARE_MIN_ROW else 0
        kernel = batch[: n - shared] if shared else batch
        return _kernel_plan(kernel, rows[: n - shared], [rows[n - shared :]] if shared else [], given)
    if batch.smallest >= kernel_max:
        return _kernel_plan(batch[:0], rows[:0], _deal(batch, max_streams, stripe), False)
    small = rows[:, 2] < np.uint64(kernel_max)
    kernel = _batch_of(rows[small])
    return _kernel_plan(kernel, np.asarray(kernel), _deal(_batch_of(rows[~small]), max_streams, stripe), False)


def _batch_of(rows: np.ndarray) -> Batch:
    """The Batch of (n, 3) rows taken from a Batch (so already checked), read in place."""
    return Batch(rows[:, 0], rows[:, 1], rows[:, 2])


def _kernel_plan(kernel: Batch, rows: np.ndarray, engines: list[np.ndarray], in_out: bool) -> CopyPlan:
    """The plan whose kernel rows are ``kernel`` (``rows``: the same rows as an array)."""
    per_row = -(-kernel.largest // KERNEL_PIECE) if len(kernel) > 1 else 1
    # Mostly empty pieces: cut on the host instead.
    if (
        per_row > 1
        and kernel.largest != kernel.smallest
        and per_row * len(kernel) > 2 * kernel.count_pieces(KERNEL_PIECE)
    ):
        return CopyPlan(np.asarray(kernel.stripe(KERNEL_PIECE)), engines, 1, in_out=False)
    return CopyPlan(rows, engines, max(per_row, 1), in_out=in_out)
