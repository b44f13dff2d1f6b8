"""Triton kernels of :func:`mori.triton.all_reduce`: one launch, flags with epochs, NVLink stores.

Both algorithms push data with plain vectorised stores into peers' symmetric buffers (mapped in
this process) and hand off with one flag per (source PE, block): the block's threads meet at a
``bar.sync``, then one thread writes the flag with a system-scope release; the receiver's one
thread polls it with a system-scope acquire and meets its block again. Flags hold the call's
epoch (a per-block counter that only grows, kept in this PE's flag area), so nothing is ever
reset and consecutive calls need no host work: the kernels are CUDA-graph friendly.

- one-shot: every PE stores its whole input into slot ``rank`` of every peer (two slot sets,
  alternating by epoch parity, so a fast PE's next call cannot overwrite data a slow PE is still
  reading), then each PE reduces all W slots locally;
- two-shot: reduce-scatter (PE j receives everybody's chunk j, reduces it, writes its output
  slice) then all-gather (PE j stores the reduced chunk into every peer's gather slot).

Sums run in fp32, over PEs in rank order on every PE, so every PE gets the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["all_reduce_kernel"]


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _signal(flag_ptr, epoch):
    # Callers put a block barrier first: bar.sync + a cumulative system-scope release publishes
    # every thread's stores before the flag.
    tl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@triton.jit
def _wait(flag_ptr, epoch, timeout_ns):
    # Wrap-safe "flag >= epoch": a peer may already be one call ahead (one-shot).
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if (seen - epoch).to(tl.int32) < 0:
        start = _globaltimer()
        while (seen - epoch).to(tl.int32) < 0:
            if _globaltimer() - start > timeout_ns:
                tl.device_print("mori all_reduce: timed out waiting for a peer's flag; epoch, seen", epoch, seen)
                tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _one_shot(inp, out, bufs, flags, mine, my_flags, rank, n, epoch, pid, nblocks, timeout_ns,
              W: tl.constexpr, MAXB: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    slots = (epoch % 2) * W * n  # this call's slot set
    for j in tl.static_range(W):
        if j != rank:
            for start in range(pid * BLOCK, n, nblocks * BLOCK):
                idx = start + offs
                m = idx < n
                tl.store(bufs[j] + slots + rank * n + idx, tl.load(inp + idx, mask=m), mask=m)
    tl.debug_barrier()
    for j in tl.static_range(W):
        if j != rank:
            _signal(flags[j] + rank * MAXB + pid, epoch)
    for j in tl.static_range(W):
        if j != rank:
            _wait(my_flags + j * MAXB + pid, epoch, timeout_ns)
    for start in range(pid * BLOCK, n, nblocks * BLOCK):
        idx = start + offs
        m = idx < n
        own = tl.load(inp + idx, mask=m).to(tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(W):
            v = tl.load(mine + slots + j * n + idx, mask=m & (j != rank), other=0.0)
            acc += tl.where(j == rank, own, v.to(tl.float32))
        tl.store(out + idx, acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _two_shot(inp, out, bufs, flags, mine, my_flags, rank, n, chunk, epoch, pid, nblocks, timeout_ns,
              W: tl.constexpr, MAXB: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    gather = W * chunk  # recv slots [0, W*chunk), gather slots after them
    # Reduce-scatter, push: my input's chunk j -> PE j's recv slot `rank`.
    for j in tl.static_range(W):
        if j != rank:
            for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
                idx = start + offs
                g = j * chunk + idx
                m = (idx < chunk) & (g < n)
                tl.store(bufs[j] + rank * chunk + idx, tl.load(inp + g, mask=m), mask=idx < chunk)
    tl.debug_barrier()
    for j in tl.static_range(W):
        if j != rank:
            _signal(flags[j] + rank * MAXB + pid, epoch)
    for j in tl.static_range(W):
        if j != rank:
            _wait(my_flags + j * MAXB + pid, epoch, timeout_ns)
    # Reduce my chunk; write my output slice and every peer's gather slot `rank`.
    for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
        idx = start + offs
        m = idx < chunk
        g = rank * chunk + idx
        mine_n = m & (g < n)  # the slice's tail past n holds zeros on every PE
        own = tl.load(inp + g, mask=mine_n, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(W):
            v = tl.load(mine + j * chunk + idx, mask=m & (j != rank), other=0.0)
            acc += tl.where(j == rank, own, v.to(tl.float32))
        r = acc.to(out.dtype.element_ty)
        tl.store(out + g, r, mask=mine_n)
        for j in tl.static_range(W):
            if j != rank:
                tl.store(bufs[j] + gather + rank * chunk + idx, r, mask=m)
    tl.debug_barrier()
    for j in tl.static_range(W):
        if j != rank:
            _signal(flags[j] + (W + rank) * MAXB + pid, epoch)
    for j in tl.static_range(W):
        if j != rank:
            _wait(my_flags + (W + j) * MAXB + pid, epoch, timeout_ns)
    # All-gather: copy the peers' reduced chunks from my gather slots to the output.
    for j in tl.static_range(W):
        if j != rank:
            for start in range(pid * BLOCK, chunk, nblocks * BLOCK):
                idx = start + offs
                g = j * chunk + idx
                m = (idx < chunk) & (g < n)
                tl.store(out + g, tl.load(mine + gather + j * chunk + idx, mask=m), mask=m)


@triton.jit
def all_reduce_kernel(inp, out, bufs, flags, mine, my_flags, epochs, rank, n, chunk, timeout_ns,
                      W: tl.constexpr, MAXB: tl.constexpr, BLOCK: tl.constexpr, ONE_SHOT: tl.constexpr):
    """Sum of ``inp`` over the W PEs into ``out`` (may alias ``inp``).

    ``bufs[j]``/``flags[j]``: PE j's data/flag area as mapped here (``mine``/``my_flags``: mine);
    ``epochs``: this PE's per-block call counters; ``chunk``: two-shot slice length (elements).
    """
    pid = tl.program_id(0)
    nblocks = tl.num_programs(0)
    epoch = tl.load(epochs + pid) + 1
    if ONE_SHOT:
        _one_shot(inp, out, bufs, flags, mine, my_flags, rank, n, epoch, pid, nblocks, timeout_ns, W, MAXB, BLOCK)
    else:
        _two_shot(inp, out, bufs, flags, mine, my_flags, rank, n, chunk, epoch, pid, nblocks, timeout_ns, W, MAXB,
                  BLOCK)
    tl.store(epochs + pid, epoch)
