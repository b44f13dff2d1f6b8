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
copy and the signal's atomic a kernel after it on the same stream.

:func:`serve_gpu` makes an engine serve both on its GPU regions: a one-thread kernel (compiled
here by NVRTC) applies each atomic on the device, on a non-blocking stream of the caller's
context, so a kernel of the target spinning on the word does not hold it back.
"""

from __future__ import annotations

import ctypes
from typing import Any, SupportsFloat

from ._native.ucx import (
    UCX_MAX_SIGNAL_PUT_BYTES,
    UcxEngine,
    UcxPeer,
    ucx_atomic,
    ucx_serve_gpu,
    ucx_signal_put,
    ucx_stop_serving_gpu,
)

__all__ = ["GPU_WORD_KERNEL", "HOST_MAPPED", "MAX_SIGNAL_PUT_BYTES", "OPS", "GpuWordServer", "atomic", "serve_gpu", "signal_put"]

#: Most bytes one :func:`signal_put` carries (they travel in its message).
MAX_SIGNAL_PUT_BYTES = UCX_MAX_SIGNAL_PUT_BYTES

#: The operations :func:`atomic` applies, by name (the codes the engine's messages carry).
OPS = {"fetch_add": 1, "compare_swap": 2, "swap": 3, "store": 4, "fetch_and": 5, "fetch_or": 6, "fetch_xor": 7}

#: ``cuMemHostAlloc`` flags of pinned host memory that kernels reach too: PORTABLE | DEVICEMAP.
HOST_MAPPED = 0x1 | 0x2

#: The kernel a target runs for an atomic on its GPU memory (parameters as the engine passes them:
#: address, op of :data:`OPS`, width in bits, value, compare, where to leave the old value).
GPU_WORD_KERNEL = r"""
template <class T>
__device__ T mori_word_apply(T* w, int op, T value, T compare) {
  switch (op) {
    case 1: return atomicAdd_system(w, value);
    case 2: return atomicCAS_system(w, compare, value);
    case 5: return atomicAnd_system(w, value);
    case 6: return atomicOr_system(w, value);
    case 7: return atomicXor_system(w, value);
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


def atomic(engine: UcxEngine, peer: UcxPeer, op: str, mem_id: int, offset: int, value: int, compare: int = 0,
           width: int = 64, timeout: SupportsFloat = 30.0) -> int:
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


def signal_put(engine: UcxEngine, peer: UcxPeer, mem_id: int, offset: int, src: int, size: int, sig_mem_id: int,
               sig_offset: int, op: str, value: int, timeout: SupportsFloat = 30.0) -> None:
    """Writes ``size`` bytes from host address ``src`` (kept alive by the caller during the call) at
    ``offset`` of ``peer``'s memory ``mem_id``, then applies ``op`` (``store`` or ``fetch_add``)
    with ``value`` to the 64-bit word at ``sig_offset`` of its memory ``sig_mem_id``, in one
    message; nothing is written when the target refuses either place. Errors as :func:`atomic`'s;
    ``size`` is at most :data:`MAX_SIGNAL_PUT_BYTES`.
    """
    if op not in ("store", "fetch_add"):
        raise ValueError(f"a signal put's op is store or fetch_add, got {op!r}")
    ucx_signal_put(engine, peer, mem_id, offset, src, size, sig_mem_id, sig_offset, OPS[op], value, timeout)


class GpuWordServer:
    """What :func:`serve_gpu` set up (module, stream, host-mapped result word); :meth:`close`
    stops the engine serving GPU memory, then frees them."""

    def __init__(self, engine: UcxEngine, context: Any, arch: str) -> None:
        from . import cuda, nvrtc

        self.engine, self.context = engine, context
        cuda.call("cuCtxSetCurrent", context)
        cubin = nvrtc.compile(GPU_WORD_KERNEL, name="mori_ucx_word_op.cu", arch=arch, output="cubin")
        self.module = cuda.call("cuModuleLoadData", cubin, detail="mori_ucx_word_op")
        drv = cuda.driver()
        self.function = cuda.call("cuModuleGetFunction", self.module, b"mori_ucx_word_op")
        self.stream = cuda.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.result = int(cuda.call("cuMemHostAlloc", 8, HOST_MAPPED))
        result_dev = int(cuda.call("cuMemHostGetDevicePointer", self.result, 0))
        ctypes.c_uint64.from_address(self.result).value = 0
        ucx_serve_gpu(engine, int(context), int(self.function), int(self.stream), self.result, result_dev,
                      cuda.entry_point("cuCtxSetCurrent"), cuda.entry_point("cuLaunchKernel"),
                      cuda.entry_point("cuStreamQuery"), cuda.entry_point("cuMemcpyHtoDAsync"))

    def close(self) -> None:
        """Refuses GPU atomics and signal puts again, then frees the kernel, stream and word."""
        from . import cuda

        ucx_stop_serving_gpu(self.engine)
        cuda.call("cuCtxSetCurrent", self.context)
        cuda.call("cuStreamDestroy", self.stream)
        cuda.call("cuModuleUnload", self.module)
        cuda.call("cuMemFreeHost", self.result)


def serve_gpu(engine: UcxEngine, context: Any, arch: str) -> GpuWordServer:
    """Makes ``engine`` apply remote atomics and signal puts that reach its GPU regions (memory
    registered with ``gpu=True``) on the device of CUDA ``context`` (compute capability ``arch``,
    ``"sm_90"``): the atomic by a one-thread kernel with a system-scope atomic (so it is atomic
    with the device's own atomics and with peers' over P2P), a signal put's bytes by a copy before
    it on the same non-blocking stream. Needs the ``mori-core[cuda]`` extra. Close the returned
    server before the context goes (after the engine stops serving peers)."""
    return GpuWordServer(engine, context, arch)
