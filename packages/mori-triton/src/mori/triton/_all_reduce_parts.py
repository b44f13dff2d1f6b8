"""Device helpers both all-reduce kernels use (v2 ``_all_reduce_fast``, v3 ``_all_reduce_lamport``)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["globaltimer", "per_lane", "rank_order_sum"]


@triton.jit
def globaltimer():
    """The GPU's ``%globaltimer`` (ns), for wait deadlines."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def per_lane(values, lanes, W: tl.constexpr):
    """The int64 tensor ``[values[0], ..., values[W-1], 0, ...]`` over ``lanes`` (no memory access)."""
    out = tl.zeros(lanes.shape, tl.int64)
    for j in tl.static_range(W):
        out = tl.where(lanes == j, values[j], out)
    return out


@triton.jit
def rank_order_sum(tile, rows, W: tl.constexpr):
    """fp32 sum of the W rows of ``tile`` in row order (``-0.0`` is the exact identity)."""
    acc = tl.full([tile.shape[1]], -0.0, tl.float32)
    for j in tl.static_range(W):
        acc += tl.sum(tl.where(rows == j, tile, -0.0), axis=0)
    return acc
