"""Flag-free kernels of :func:`mori.triton.all_reduce` ("v3"): the data is its own signal.

v2 hands data over with a flag: the writer's release store must wait until every earlier
store of its block has reached the peer (an NVLink round trip), and only then does the flag
start its own one-way trip. v3 removes both from the critical path, the way a Lamport clock
needs no lock: every receive slot holds a *sentinel* (all bits set: a NaN no input can hold)
until a peer's store replaces it, and the receiver polls the data itself until no element of its
tile is the sentinel. Elements are at most 4 bytes and naturally aligned, so each one is written
in a single piece even when a 16-byte vector store is split on the way: an element that is not
the sentinel is final. After reading, the receiver writes the sentinel back.

- inputs are pushed with the one bit pattern that is the sentinel changed to another NaN (the
  sign bit cleared), so a NaN stays a NaN and every other value is untouched;
- three slot sets rotate per call (a per-block counter kept in this PE's flag area): a peer that
  runs a call ahead writes the next set, never the one still being read; the set it reaches again
  two calls later was consumed and reset before this PE could finish the call that let the peer
  get that far;
- every wait polls with a ``%globaltimer`` deadline and traps with a message when it passes.

One-shot: every PE pushes its whole input into slot ``rank`` of every peer's set, then sums the W
slots of its own set. Two-shot: chunk j of every input goes to PE j (reduce-scatter), PE j sums
it and pushes the result into every peer's gather slot (all-gather). Sums are fp32 in rank
order, bit-identical to v2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._all_reduce_parts import globaltimer, per_lane, rank_order_sum

__all__ = ["all_reduce_lamport_kernel", "SETS"]

SETS = tl.constexpr(3)  # slot sets in rotation (host code reads SETS.value)


@triton.jit
def _bits(x):
    """``x`` reinterpreted as signed integers of its width (the sentinel is -1)."""
    if x.dtype.primitive_bitwidth == 16:
        return x.to(tl.int16, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def _not_sentinel(x):
    """``x`` with the sentinel pattern (all ones, a negative NaN) turned into a positive NaN."""
    b = _bits(x)
    if x.dtype.primitive_bitwidth == 16:
        b = tl.where(b == -1, b & 32767, b)
    else:
        b = tl.where(b == -1, b & 2147483647, b)
    return b.to(x.dtype, bitcast=True)


@triton.jit
def _sentinel_like(x):
    return tl.full(x.shape, -1, _bits(x).dtype).to(x.dtype, bitcast=True)


@triton.jit
def _poll(ptrs, mask, timeout_ns):
    """Loads the tile at ``ptrs`` (volatile: never a stale cached copy) until no element under
    ``mask`` is the sentinel; traps after ``timeout_ns``. Masked-off elements read as -0.0."""
    tile = tl.load(ptrs, mask=mask, other=-0.0, volatile=True)
    missing = tl.max((mask & (_bits(tile) == -1)).to(tl.int32))
    if missing != 0:
        start = globaltimer()
        late = 0
        while (missing != 0) & (late == 0):
            tile = tl.load(ptrs, mask=mask, other=-0.0, volatile=True)
            missing = tl.max((mask & (_bits(tile) == -1)).to(tl.int32))
            late = (globaltimer() - start > timeout_ns).to(tl.int32)
        if missing != 0:
            tl.device_print("mori all_reduce: timed out waiting for a peer's data (v3)", missing)
            tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    return tile


@triton.jit
def _one_shot(inp, out, slots, rows, deltas, n, rank, pid, nblocks, timeout_ns, W: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)[None, :]
    peers = (rows < W) & (rows != rank)
    # Push: my input -> slot `rank` of every peer's set.
    for start in range(pid * BLOCK, n, nblocks * BLOCK):
        idx = start + cols
        m = idx < n
        x = _not_sentinel(tl.load(inp + idx, mask=m))
        tl.store(slots + deltas + rank * n + idx, tl.broadcast_to(x, (rows.shape[0], BLOCK)), mask=m & peers)
    # Sum the slots as they arrive, then give them back to the sentinel.
    for start in range(pid * BLOCK, n, nblocks * BLOCK):
        idx = start + cols
        m = idx < n
        tile = _poll(slots + rows * n + idx, m & peers, timeout_ns)
        acc = tile.to(tl.float32)
        acc += tl.load(inp + idx + 0 * rows, mask=m & (rows == rank), other=-0.0).to(tl.float32)
        tl.store(out + idx, rank_order_sum(acc, rows, W)[None, :].to(out.dtype.element_ty), mask=m)
        tl.store(slots + rows * n + idx, _sentinel_like(tile), mask=m & peers)


@triton.jit
def _two_shot(
    inp, out, recv, rows, deltas, n, chunk, rank, pid, nblocks, timeout_ns, W: tl.constexpr, BLOCK: tl.constexpr
):
    cols = tl.arange(0, BLOCK)[None, :]
    peers = (rows < W) & (rows != rank)
    gather = recv + W * chunk
    # Reduce-scatter push: row j = my input's chunk j -> PE j's recv slot `rank`. The whole slice
    # is written (zeros past n), since the receiver waits for every element of it.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        g = rows * chunk + idx
        x = _not_sentinel(tl.load(inp + g, mask=peers & (idx < chunk) & (g < n), other=0.0))
        tl.store(recv + deltas + rank * chunk + idx, x, mask=peers & (idx < chunk))
    # Reduce my chunk as the peers' slices arrive; write my output slice and every peer's gather
    # slot `rank`; give the recv slots back.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        m = idx < chunk
        g = rank * chunk + idx
        tile = _poll(recv + rows * chunk + idx, m & peers, timeout_ns)
        acc = tile.to(tl.float32)
        acc += tl.load(inp + g + 0 * rows, mask=m & (g < n) & (rows == rank), other=-0.0).to(tl.float32)
        r = _not_sentinel(rank_order_sum(acc, rows, W)[None, :].to(out.dtype.element_ty))
        tl.store(out + g, r, mask=m & (g < n))
        tl.store(gather + deltas + rank * chunk + idx, tl.broadcast_to(r, (rows.shape[0], BLOCK)), mask=m & peers)
        tl.store(recv + rows * chunk + idx, _sentinel_like(tile), mask=m & peers)
    # All-gather: the peers' reduced chunks, from my gather slots to the output.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        g = rows * chunk + idx
        m = peers & (idx < chunk)
        tile = _poll(gather + rows * chunk + idx, m, timeout_ns)
        tl.store(out + g, tile, mask=m & (g < n))
        tl.store(gather + rows * chunk + idx, _sentinel_like(tile), mask=m)


@triton.jit
def all_reduce_lamport_kernel(
    inp,
    out,
    lam,
    sets,
    deltas,
    rank,
    n,
    chunk,
    timeout_ns,
    set_elems,
    W: tl.constexpr,
    WP: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_SHOT: tl.constexpr,
):
    """Sum of ``inp`` over the W PEs into ``out`` (may alias ``inp``).

    ``lam``: this PE's slot area, ``SETS`` sets of ``set_elems`` elements, all sentinel between
    calls; PE j's copy, as mapped here, is at element offset ``deltas[j]`` (multiples of 64).
    ``sets``: this PE's per-block set counters; ``chunk``: two-shot slice length (a multiple of
    64 elements); ``WP``: W rounded up to a power of two.
    """
    pid = tl.program_id(0)
    nblocks = tl.num_programs(0)
    s = tl.load(sets + pid)
    slots = lam + s * set_elems
    lanes = tl.arange(0, WP)
    rows = lanes[:, None]
    deltas2 = tl.multiple_of(per_lane(deltas, lanes, W), 64)[:, None]
    if ONE_SHOT:
        _one_shot(inp, out, slots, rows, deltas2, n, rank, pid, nblocks, timeout_ns, W, BLOCK)
    else:
        _two_shot(inp, out, slots, rows, deltas2, n, chunk, rank, pid, nblocks, timeout_ns, W, BLOCK)
    tl.store(sets + pid, (s + 1) % SETS)
