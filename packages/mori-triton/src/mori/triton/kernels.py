"""Example kernels on mori's device API: put/get rings and the seed's two all-reduce kernels.

Each is a plain ``@triton.jit`` kernel; launch through :func:`mori.triton.jit` (or pass
``extern_libs=get_extern_libs()`` with the hook installed). Buffers are symmetric addresses
(``shmem_malloc`` or ``shmem_tensor``), passed as tensors or as int64 addresses.

- :data:`put_ring_kernel` / :data:`get_ring_kernel`: block b moves bytes ``[b*per_block, ...)``
  to / from the next PE with ``putmem_nbi_block`` / ``getmem_nbi_block`` and ``quiet_thread``;
- :data:`allreduce_p2p_kernel` (kernel A): each block resolves every PE's copy of the input with
  ``ptr_p2p`` and reads it with ``tl.load``, accumulating in fp32;
- :data:`allreduce_put_signal_kernel` (kernel B): block ``b`` sends chunk ``b % CHUNKS_PER_PE``
  of the input to PE ``b // CHUNKS_PER_PE`` with ``putmem_nbi_signal_block`` and ``SIGNAL_ADD``;
  every block then waits for all ``W * CHUNKS_PER_PE`` signals of this call
  (``uint64_wait_until_equals`` on a counter that only grows) and reduces its slice locally.
- :data:`PUT_RING_IR`: the put ring as LLVM IR text, for :func:`mori.triton.compile_ir`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import shmem as ms

__all__ = ["PUT_RING_IR", "allreduce_p2p_kernel", "allreduce_put_signal_kernel", "get_ring_kernel", "put_ring_kernel"]


@triton.jit
def put_ring_kernel(dst, src, nbytes, per_block):
    """Puts this PE's ``src`` into ``dst`` on PE ``(me + 1) % n``, ``per_block`` bytes per block."""
    start = tl.program_id(0).to(tl.int64) * per_block
    size = tl.minimum(nbytes - start, per_block)
    if size > 0:
        peer = (ms.my_pe() + 1) % ms.n_pes()
        ms.putmem_nbi_block(dst.to(tl.int64) + start, src.to(tl.int64) + start, size, peer)
        ms.quiet_thread()


@triton.jit
def get_ring_kernel(dst, src, nbytes, per_block):
    """Gets ``src`` of PE ``(me + 1) % n`` into local ``dst``, ``per_block`` bytes per block."""
    start = tl.program_id(0).to(tl.int64) * per_block
    size = tl.minimum(nbytes - start, per_block)
    if size > 0:
        peer = (ms.my_pe() + 1) % ms.n_pes()
        ms.getmem_nbi_block(dst.to(tl.int64) + start, src.to(tl.int64) + start, size, peer)
        ms.quiet_thread()


@triton.jit
def allreduce_p2p_kernel(sym_in, out, n, BLOCK: tl.constexpr):
    """Kernel A: ``out = sum over PEs of sym_in`` (fp32 accumulation, PEs in rank order)."""
    me = ms.my_pe()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for pe in range(0, ms.n_pes()):
        peer = ms.ptr_p2p(sym_in, me, pe).to(tl.pointer_type(out.dtype.element_ty))
        acc += tl.load(peer + offs, mask=mask).to(tl.float32)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["epoch"])  # epoch 1 would otherwise become a constant
def allreduce_put_signal_kernel(sym_in, sym_recv, sig, out, n, epoch, CHUNKS_PER_PE: tl.constexpr, BLOCK: tl.constexpr):
    """Kernel B: ``sym_recv[p]`` on every PE receives PE p's input; ``out`` gets the fp32-accumulated sum.

    ``sig``: a symmetric uint64 counter, zero before the first call; ``epoch``: 1 for the first
    call, then 2, 3, ... (the counter reaches ``epoch * n_pes * CHUNKS_PER_PE``). Grid:
    ``n_pes * CHUNKS_PER_PE`` blocks; ``n`` a multiple of ``CHUNKS_PER_PE``. A PE must not start
    the next call before every PE finished this one (a barrier between calls).
    """
    pid = tl.program_id(0)
    me = ms.my_pe()
    npes = ms.n_pes()
    esize = out.dtype.element_ty.primitive_bitwidth // 8
    chunk = tl.cdiv(n, CHUNKS_PER_PE)
    dest_pe = pid // CHUNKS_PER_PE
    c = pid % CHUNKS_PER_PE
    first = c * chunk
    count = tl.minimum(n - first, chunk)
    dst = sym_recv.to(tl.int64) + (me.to(tl.int64) * n + first) * esize
    src = sym_in.to(tl.int64) + first.to(tl.int64) * esize
    ms.putmem_nbi_signal_block(dst, src, count.to(tl.int64) * esize, sig, 1, ms.SIGNAL_ADD, dest_pe)
    ms.uint64_wait_until_equals(sig, epoch.to(tl.uint64) * npes * CHUNKS_PER_PE)
    per = tl.cdiv(n, tl.num_programs(0))
    for start in range(pid * per, tl.minimum(pid * per + per, n), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = (offs < n) & (offs < pid * per + per)
        acc = tl.zeros([BLOCK], tl.float32)
        for pe in range(0, npes):
            acc += tl.load(sym_recv + pe * n + offs, mask=mask).to(tl.float32)
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


PUT_RING_IR = """
define ptx_kernel void @mori_ir_put_ring(i64 %dst, i64 %src, i64 %nbytes) {
entry:
  %pe = call i32 @mori_shmem_my_pe()
  %npes = call i32 @mori_shmem_n_pes()
  %next = add i32 %pe, 1
  %peer = srem i32 %next, %npes
  %put = call i32 @mori_shmem_putmem_nbi_block(i64 %dst, i64 %src, i64 %nbytes, i32 %peer, i32 0)
  %quiet = call i32 @mori_shmem_quiet_thread()
  ret void
}
"""
