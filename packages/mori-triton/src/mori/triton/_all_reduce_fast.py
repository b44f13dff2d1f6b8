"""Latency-first kernels of :func:`mori.triton.all_reduce` ("v2").

One flag per (phase, source PE, block), epochs that only grow, two one-shot slot sets; every
step runs for all peers at once:

- **signals** are ``st.release.sys`` stores issued by W lanes of warp 0 in parallel, after a
  ``bar.sync`` (one ``atom.exch.release.sys`` per peer in turn would wait for each previous
  atomic's NVLink round trip at its fence);
- **waits** spin inside one inline-PTX loop per lane (``ld.acquire.sys`` + ``%globaltimer``
  deadline), all peers' flags at once, then meet at one ``bar.sync``;
- **data** moves as 2-D tiles ``[WP, BLOCK]`` (row j = peer j): one tile of loads is issued
  before any of its stores, so W-1 peers' worth of 16-byte accesses are in flight per thread.
  Peer addresses are a typed base pointer (``mine``) plus per-row element offsets
  (``deltas``) declared ``tl.multiple_of``, which keeps Triton's 16-byte vectorisation.

Sums are fp32 in rank order (row j is added as ``sum(where(row == j, tile, -0.0))``, which is
exact), so results are bit-identical to ``sum(x_r.float() for r in ranks)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._all_reduce_parts import per_lane, rank_order_sum

__all__ = ["all_reduce_fast_kernel"]

# One lane per peer: spin until the flag at $1 reaches epoch $3 (wrap-safe signed difference),
# or until $4 ns passed; returns the last value seen. Labels are local to the { } scope, so the
# snippet may appear several times in one kernel. Lanes with $2 == 0 return $3 at once.
_WAIT_PTX = tl.constexpr("""{
.reg .pred %pw;
.reg .b32 %dw;
.reg .b64 %t0, %t1;
mov.b32 $0, $3;
setp.eq.s32 %pw, $2, 0;
@%pw bra DONE;
mov.u64 %t0, %globaltimer;
POLL:
ld.acquire.sys.global.b32 $0, [$1];
sub.s32 %dw, $0, $3;
setp.ge.s32 %pw, %dw, 0;
@%pw bra DONE;
mov.u64 %t1, %globaltimer;
sub.u64 %t1, %t1, %t0;
setp.lt.u64 %pw, %t1, $4;
@%pw bra POLL;
DONE:
}""")

# One lane per peer: a release store of the epoch $3 into the peer's flag $1 when $2 != 0.
_SIGNAL_PTX = tl.constexpr("""{
.reg .pred %ps;
setp.ne.s32 %ps, $2, 0;
@%ps st.release.sys.global.b32 [$1], $3;
mov.b32 $0, 0;
}""")


@triton.jit
def _thread_id(like):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _signal_peers(flag_addr, active, epoch):
    tl.debug_barrier()  # every thread's stores precede the release (cumulative through bar.sync)
    tl.inline_asm_elementwise(
        _SIGNAL_PTX,
        "=r,l,r,r",
        [flag_addr, active.to(tl.int32), epoch + tl.zeros(active.shape, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _wait_peers(flag_addr, active, epoch, timeout_ns):
    seen = tl.inline_asm_elementwise(
        _WAIT_PTX,
        "=r,l,r,r,l",
        [
            flag_addr,
            active.to(tl.int32),
            epoch + tl.zeros(active.shape, tl.int32),
            timeout_ns + tl.zeros(active.shape, tl.int64),
        ],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
    late = tl.max((active & ((seen - epoch) < 0)).to(tl.int32), axis=0)
    if late != 0:
        tl.device_print("mori all_reduce: timed out waiting for a peer's flag; epoch", epoch)
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()  # the acquiring lanes' view reaches every thread of the block


@triton.jit
def _one_shot(
    inp,
    out,
    mine,
    rows,
    deltas,
    n,
    rank,
    epoch,
    pid,
    nblocks,
    flag_out,
    flag_in,
    active,
    timeout_ns,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)[None, :]
    peers = (rows < W) & (rows != rank)
    slots = (epoch & 1) * W * n  # this call's slot set
    # Push: my input -> slot `rank` of every peer (one load, W-1 stores per element).
    for start in range(pid * BLOCK, n, nblocks * BLOCK):
        idx = start + cols
        m = idx < n
        x = tl.load(inp + idx, mask=m)
        tl.store(mine + deltas + slots + rank * n + idx, tl.broadcast_to(x, (rows.shape[0], BLOCK)), mask=m & peers)
    _signal_peers(flag_out, active, epoch)
    _wait_peers(flag_in, active, epoch, timeout_ns)
    for start in range(pid * BLOCK, n, nblocks * BLOCK):
        idx = start + cols
        m = idx < n
        tile = tl.load(mine + slots + rows * n + idx, mask=m & peers, other=-0.0).to(tl.float32)
        tile += tl.load(inp + idx + 0 * rows, mask=m & (rows == rank), other=-0.0).to(tl.float32)
        acc = rank_order_sum(tile, rows, W)
        tl.store(out + idx, acc[None, :].to(out.dtype.element_ty), mask=m)


@triton.jit
def _two_shot(
    inp,
    out,
    mine,
    rows,
    deltas,
    n,
    chunk,
    rank,
    epoch,
    pid,
    nblocks,
    flag_out,
    flag_in,
    active,
    timeout_ns,
    W: tl.constexpr,
    MAXB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)[None, :]
    peers = (rows < W) & (rows != rank)
    gather = W * chunk  # recv slots [0, W*chunk), gather slots after them
    # Reduce-scatter, push: row j of the tile = my input's chunk j -> PE j's recv slot `rank`.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        g = rows * chunk + idx
        x = tl.load(inp + g, mask=peers & (idx < chunk) & (g < n), other=0.0)
        tl.store(mine + deltas + rank * chunk + idx, x, mask=peers & (idx < chunk))
    _signal_peers(flag_out, active, epoch)
    _wait_peers(flag_in, active, epoch, timeout_ns)
    # Reduce my chunk; write my output slice and every peer's gather slot `rank`.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        m = idx < chunk
        g = rank * chunk + idx
        tile = tl.load(mine + rows * chunk + idx, mask=m & peers, other=-0.0).to(tl.float32)
        # the slice's tail past n holds zeros on every PE
        tile += tl.load(inp + g + 0 * rows, mask=m & (g < n) & (rows == rank), other=-0.0).to(tl.float32)
        r = rank_order_sum(tile, rows, W)[None, :].to(out.dtype.element_ty)
        tl.store(out + g, r, mask=m & (g < n))
        tl.store(
            mine + deltas + gather + rank * chunk + idx, tl.broadcast_to(r, (rows.shape[0], BLOCK)), mask=m & peers
        )
    _signal_peers(flag_out + W * MAXB * 4, active, epoch)  # phase-1 flags (int64 byte addresses)
    _wait_peers(flag_in + W * MAXB * 4, active, epoch, timeout_ns)
    # All-gather: the peers' reduced chunks, from my gather slots to the output.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + cols
        g = rows * chunk + idx
        m = peers & (idx < chunk) & (g < n)
        tl.store(out + g, tl.load(mine + gather + rows * chunk + idx, mask=m), mask=m)


@triton.jit
def all_reduce_fast_kernel(
    inp,
    out,
    mine,
    my_flags,
    epochs,
    deltas,
    flag_deltas,
    rank,
    n,
    chunk,
    timeout_ns,
    W: tl.constexpr,
    WP: tl.constexpr,
    MAXB: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_SHOT: tl.constexpr,
):
    """Sum of ``inp`` over the W PEs into ``out`` (may alias ``inp``).

    ``mine``/``my_flags``: this PE's data/flag area; PE j's copy, as mapped here, is at element
    offset ``deltas[j]`` / ``flag_deltas[j]`` from them (multiples of 64: areas are 256-byte
    aligned). ``epochs``: this PE's per-block call counters; ``chunk``: two-shot slice length
    (a multiple of 64 elements); ``WP``: W rounded up to a power of two.
    """
    pid = tl.program_id(0)
    nblocks = tl.num_programs(0)
    epoch = tl.load(epochs + pid).to(tl.int32, bitcast=True) + 1  # wraps; compared as signed differences
    lanes = tl.arange(0, WP)
    rows = lanes[:, None]
    deltas2 = tl.multiple_of(per_lane(deltas, lanes, W), 64)[:, None]
    # Flag of this block in phase 0: mine from PE j at [j][pid], mine at PE j at [rank][pid].
    fdeltas = per_lane(flag_deltas, lanes, W)
    flag_out = (my_flags + fdeltas + rank * MAXB + pid).to(tl.int64)
    flag_in = (my_flags + lanes * MAXB + pid).to(tl.int64)
    # Lanes of warp 0 talk to the peers, one lane each.
    active = (lanes < W) & (lanes != rank) & (_thread_id(lanes) < 32)
    if ONE_SHOT:
        _one_shot(
            inp, out, mine, rows, deltas2, n, rank, epoch, pid, nblocks, flag_out, flag_in, active, timeout_ns, W, BLOCK
        )
    else:
        _two_shot(
            inp,
            out,
            mine,
            rows,
            deltas2,
            n,
            chunk,
            rank,
            epoch,
            pid,
            nblocks,
            flag_out,
            flag_in,
            active,
            timeout_ns,
            W,
            MAXB,
            BLOCK,
        )
    tl.store(epochs + pid, epoch.to(tl.uint32, bitcast=True))
