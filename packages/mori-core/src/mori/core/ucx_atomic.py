"""Remote atomics and signal puts on mori-core's UCX engine (:mod:`mori.core.ucx`): what
symmetric-memory callers (mori.shmem's remote transport) need beyond bulk puts and gets.

:func:`atomic` applies fetch-add, compare-swap, swap, store, fetch-and, fetch-or or fetch-xor to a
32- or 64-bit word of a peer engine's registered memory and returns the word's old value. It
travels on the engine's checked path: the target checks the word against its live registrations
(inside the region, aligned to its width) before touching it, applies the operation with a
sequentially consistent atomic (host memory) or a system-scope atomic on the device (GPU memory
that the target serves with :func:`serve_gpu`; without it GPU memory is refused), and answers
with the old value or why it refused. The calling thread waits (GIL released) for the answer,
progressing the engine's worker itself first.

:func:`signal_put` writes up to :data:`MAX_SIGNAL_PUT_BYTES` and then sets or adds to a 64-bit
signal word, in one message: the target checks both places, writes the bytes, then applies the
signal's atomic, so whoever sees the signal sees the data. On GPU memory the bytes are a copy-engine
copy and the signal follows on the same stream: a set written by the stream itself
(``cuStreamWriteValue64``), an add by the atomics' kernel. The target answers once both ended (a
set with bytes runs on while its worker takes the next messages).

:func:`serve_gpu` makes an engine serve both on its GPU regions: a one-thread kernel (compiled
here by NVRTC) applies each atomic on the device, on a non-blocking stream of the caller's
context, so a kernel of the target spinning on the word does not hold it back.
"""

from __future__ import annotations

import ctypes
from typing import Any, SupportsFloat

from ._native.ucx import (
    UCX_GPU_ENTRY_POINTS,
    UCX_MAX_SIGNAL_PUT_BYTES,
    UcxEngine,
    UcxPeer,
    ucx_atomic,
    ucx_serve_gpu,
    ucx_signal_put,
    ucx_stop_serving_gpu,
)
from .codes import AtomicOp

__all__ = [
    "BOUNCE_BYTES",
    "GPU_WORD_KERNEL",
    "HOST_MAPPED",
    "MAX_SIGNAL_PUT_BYTES",
    "OPS",
    "GpuWordServer",
    "atomic",
    "serve_gpu",
    "signal_put",
]

#: Most bytes one :func:`signal_put` carries (they travel in its message).
MAX_SIGNAL_PUT_BYTES = UCX_MAX_SIGNAL_PUT_BYTES

#: The operations :func:`atomic` applies, by name (:class:`mori.core.codes.AtomicOp`'s codes, which
#: the engine's messages carry).
OPS = {op.name.lower(): op.value for op in AtomicOp}

#: ``cuMemHostAlloc`` flags of pinned host memory that kernels reach too: PORTABLE | DEVICEMAP.
HOST_MAPPED = 0x1 | 0x2

#: The kernel a target runs for an atomic on its GPU memory (parameters as the engine passes them:
#: address, op of :data:`OPS`, width in bits, value, compare, where to leave the old value).
GPU_WORD_KERNEL = (
    "".join(f"constexpr int kMori{op.name.title().replace('_', '')} = {op.value};\n" for op in AtomicOp)
    + r"""
template <class T>
__device__ T mori_word_apply(T* w, int op, T value, T compare) {
  switch (op) {
    case kMoriFetchAdd: return atomicAdd_system(w, value);
    case kMoriCompareSwap: return atomicCAS_system(w, compare, value);
    case kMoriFetchAnd: return atomicAnd_system(w, value);
    case kMoriFetchOr: return atomicOr_system(w, value);
    case kMoriFetchXor: return atomicXor_system(w, value);
    default: return atomicExch_system(w, value);  // swap, store
  }
}
extern "C" __global__ void mori_ucx_word_op(unsigned long long addr, int op, int width, unsigned long long value,
                                            unsigned long long compare, unsigned long long result) {
  unsigned long long old;
  if (width == 64) {
    old = mori_word_apply<unsigned long long>(reinterpret_cast<unsigned long long*>(addr), op, value, compare);
  } else {
    old = mori_word_apply<unsigned int>(reinterpret_cast<unsigned int*>(addr), op, (unsigned int)value,
                                        (unsigned int)compare);
  }
  *reinterpret_cast<volatile unsigned long long*>(result) = old;
  __threadfence_system();
}
"""
)


def atomic(
    engine: UcxEngine,
    peer: UcxPeer,
    op: str,
    mem_id: int,
    offset: int,
    value: int,
    compare: int = 0,
    width: int = 64,
    timeout: SupportsFloat = 30.0,
) -> int:
    """Applies ``op`` (a key of :data:`OPS`; ``compare_swap`` writes ``value`` where the word holds
    ``compare``) to the ``width``-bit word at ``offset`` of ``peer``'s memory ``mem_id``; returns
    its old value (unsigned).

    ``peer`` must come from ``engine.connect``. Raises ``ValueError`` for a bad argument or when
    the target refused (the message says why), ``RuntimeError`` when the peer failed or did not
    answer within ``timeout`` seconds.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return ucx_atomic(engine, peer, OPS[op], mem_id, offset, value, compare, width, timeout)


def signal_put(
    engine: UcxEngine,
    peer: UcxPeer,
    mem_id: int,
    offset: int,
    src: int,
    size: int,
    sig_mem_id: int,
    sig_offset: int,
    op: str,
    value: int,
    timeout: SupportsFloat = 30.0,
) -> None:
    """Writes ``size`` bytes from host address ``src`` (kept alive by the caller during the call) at
    ``offset`` of ``peer``'s memory ``mem_id``, then applies ``op`` (``store`` or ``fetch_add``)
    with ``value`` to the 64-bit word at ``sig_offset`` of its memory ``sig_mem_id``, in one
    message; nothing is written when the target refuses either place. Errors as :func:`atomic`'s;
    ``size`` is at most :data:`MAX_SIGNAL_PUT_BYTES`.
    """
    if op not in ("store", "fetch_add"):
        raise ValueError(f"a signal put's op is store or fetch_add, got {op!r}")
    ucx_signal_put(engine, peer, mem_id, offset, src, size, sig_mem_id, sig_offset, OPS[op], value, timeout)


#: Bytes of the pinned bounce buffer the small GPU copies of :func:`serve_gpu` (a signal put's
#: bytes) go through.
BOUNCE_BYTES = 1 << 20


class GpuWordServer:
    """What :func:`serve_gpu` set up (a CUDA context of its own, with the kernel's module, a
    stream, a host-mapped result word and a pinned bounce buffer); :meth:`close` stops the engine
    serving GPU memory, then frees them."""

    def __init__(self, engine: UcxEngine, context: Any, arch: str, stage: bool) -> None:
        from . import cuda, nvrtc

        self.engine, self.caller = engine, context
        cuda.call("cuCtxSetCurrent", context)
        self.context = cuda.create_context(cuda.call("cuCtxGetDevice"))
        try:
            cubin = nvrtc.compile(GPU_WORD_KERNEL, name="mori_ucx_word_op.cu", arch=arch, output="cubin")
            self.module = cuda.call("cuModuleLoadData", cubin, detail="mori_ucx_word_op")
            drv = cuda.driver()
            self.function = cuda.call("cuModuleGetFunction", self.module, b"mori_ucx_word_op")
            # Loaded now, while nothing runs in this context (a lazy load would wait for the GPU).
            cuda.call(
                "cuFuncGetAttribute", drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, self.function
            )
            self.stream = cuda.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self.result = int(cuda.call("cuMemHostAlloc", 8, HOST_MAPPED))
            self.bounce = int(cuda.call("cuMemHostAlloc", BOUNCE_BYTES, HOST_MAPPED))
            result_dev = int(cuda.call("cuMemHostGetDevicePointer", self.result, 0))
            ctypes.c_uint64.from_address(self.result).value = 0
            entry_points = {name: cuda.entry_point(name) for name in UCX_GPU_ENTRY_POINTS}
            ucx_serve_gpu(
                engine,
                int(self.context),
                int(self.function),
                int(self.stream),
                self.result,
                result_dev,
                entry_points,
                self.bounce,
                BOUNCE_BYTES,
                stage,
            )
        finally:
            cuda.call("cuCtxSetCurrent", context)

    def close(self) -> None:
        """Refuses GPU atomics and signal puts again, then frees the context and what it holds."""
        from . import cuda

        ucx_stop_serving_gpu(self.engine)
        cuda.call("cuCtxDestroy", self.context)  # its stream, module and pinned memory with it
        cuda.call("cuCtxSetCurrent", self.caller)


def serve_gpu(engine: UcxEngine, context: Any, arch: str, stage: bool = True) -> GpuWordServer:
    """Makes ``engine`` apply remote atomics and signal puts that reach its GPU regions (memory
    registered with ``gpu=True``) on the device of CUDA ``context`` (compute capability ``arch``,
    ``"sm_90"``): the atomic by a one-thread kernel with a system-scope atomic (so it is atomic
    with the device's own atomics and with peers' over P2P), a signal put's bytes by a copy before
    it on the same non-blocking stream.

    With ``stage`` (the default), every transfer of GPU memory on the engine's checked path goes
    through host memory too: blocks go in pieces (1 MiB, doubling up to 4 MiB), each copied
    asynchronously between the GPU and pinned host memory of this server's context, which the
    engine lends each transfer and keeps for reuse (up to 256 MiB), so that the copies of some
    pieces overlap the network moving others; UCX moves host memory only. All of it runs in a CUDA context of its own, never in
    ``context``: a kernel of the application waiting on the engine (a device proxy's put) then
    cannot deadlock with the application's host thread holding the primary context's lock (a
    lazily loaded kernel, a copy to pageable memory behind a running kernel). ``stage=False``
    leaves GPU memory to UCX's CUDA support (GPUDirect RDMA on a NIC), in the primary context.

    Needs the ``mori-core[cuda]`` extra and GPU memory that every context of the device reaches
    (CUDA VMM mappings, as mori.shmem's heap). Close the returned server before ``context`` goes
    (after the engine stops serving peers): closing waits, at most the engine's timeout, for staged
    memory still in use, then frees it."""
    return GpuWordServer(engine, context, arch, stage)
