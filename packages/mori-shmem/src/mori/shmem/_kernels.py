"""Device helpers the host API runs on a GPU heap: atomics for Python callers, the stream barrier.

They are written against mori's device API (``mori/device/shmem.cuh``), compiled once per
architecture by NVRTC (cached on disk), and loaded into this process's context; the module gets
the PE's device state through the same :meth:`HostOps.module_init` that users call for Triton
modules.
"""

from __future__ import annotations

import ctypes
from typing import Any

from mori.core import cuda as cu
from mori.core import nvrtc

from ._cuda import Context, launch
from ._heap import RESULT_OFFSET, Heap

__all__ = ["HOST_OPS_SOURCE", "HostOps", "compile_cubin", "load_module"]

_OPS = {"fetch_add": 0, "compare_swap": 1, "swap": 2, "store": 3}

HOST_OPS_SOURCE = r"""
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
using namespace mori::device;

template <typename T>
__device__ T hostAtomic(int op, T* dest, T value, T compare, int pe) {
  switch (op) {
    case 0: return ShmemAtomicFetchAdd<T>(dest, value, pe);
    case 1: return ShmemAtomicCompareSwap<T>(dest, compare, value, pe);
    case 2: return ShmemAtomicSwap<T>(dest, value, pe);
    default: return ShmemAtomicSwap<T>(dest, value, pe);  // store: a swap whose old value is dropped
  }
}

// One thread applies one atomic to PE `pe` and leaves the old value at `result`.
extern "C" __global__ void mori_shmem_host_atomic(int op, int width, unsigned long long dest, int pe,
                                                  unsigned long long value, unsigned long long compare,
                                                  unsigned long long result) {
  unsigned long long old;
  if (width == 32) {
    old = hostAtomic<uint32_t>(op, reinterpret_cast<uint32_t*>(dest), (uint32_t)value, (uint32_t)compare, pe);
  } else {
    old = hostAtomic<uint64_t>(op, reinterpret_cast<uint64_t*>(dest), (uint64_t)value, (uint64_t)compare, pe);
  }
  *reinterpret_cast<unsigned long long*>(result) = old;
  ShmemQuietThread();
}

// shmem_barrier_on_stream: one block joins the device barrier of all PEs.
extern "C" __global__ void mori_shmem_barrier_kernel() { ShmemBarrierAllBlock(); }
"""


_INCLUDE = "#include <mori/device/shmem.cuh>"
# The NVRTC on the device machine (older than 13.5) rejects __builtin_offsetof, which state.cuh's
# layout static_asserts use. The layout is checked on the host (the ctypes mirror and the header
# tests), so the asserts are dropped while the headers are read. Remove once state.cuh compiles there.
_COMPAT_INCLUDE = f"#define static_assert(...)\n{_INCLUDE}\n#undef static_assert"


def compile_cubin(source: str, name: str, arch: str) -> bytes:
    """Compiles ``source`` (on mori's device headers) for ``arch`` (``sm_90`` ...), cached on disk."""
    return nvrtc.compile(source.replace(_INCLUDE, _COMPAT_INCLUDE, 1), name=name, arch=arch, output="cubin")


def load_module(ctx: Context, source: str, name: str) -> Any:
    """Compiles ``source`` for the context's GPU and loads it; returns the ``CUmodule``."""
    cubin = compile_cubin(source, name, ctx.arch)
    ctx.make_current()
    return cu.call("cuModuleLoadData", cubin, detail=name)


def module_handle(module: Any) -> Any:
    """A ``CUmodule`` from an int handle (Triton's ``kernel.module``) or a ``CUmodule``."""
    drv = cu.driver()
    if isinstance(module, drv.CUmodule):
        return module
    if isinstance(module, int) and not isinstance(module, bool) and module != 0:
        return drv.CUmodule(module)
    raise TypeError(f"expected a CUmodule or a non-zero int module handle, got {module!r}")


class HostOps:
    """The helper kernels, loaded for one PE with its device state."""

    def __init__(self, ctx: Context, heap: Heap, states: bytes, fast_states: bytes) -> None:
        self.ctx = ctx
        self.heap = heap
        self.states = states
        self.fast_states = fast_states
        self.module = load_module(ctx, HOST_OPS_SOURCE, "mori_shmem_host_ops.cu")
        self.module_init(self.module)
        self._atomic = cu.call("cuModuleGetFunction", self.module, b"mori_shmem_host_atomic")
        self._barrier = cu.call("cuModuleGetFunction", self.module, b"mori_shmem_barrier_kernel")

    def module_init(self, module: Any) -> None:
        """Copies the device state into ``globalGpuStates`` and its constant-memory mirror into
        ``globalGpuStatesFast`` of ``module`` (each where the module has it; a module with
        neither is skipped)."""
        handle = module_handle(module)
        self.ctx.make_current()
        for symbol, data in ((b"globalGpuStates", self.states), (b"globalGpuStatesFast", self.fast_states)):
            self._write_global(handle, symbol, data)

    @staticmethod
    def _write_global(handle: Any, symbol: bytes, data: bytes) -> None:
        drv = cu.driver()
        err, ptr, size = drv.cuModuleGetGlobal(handle, symbol)
        if err == drv.CUresult.CUDA_ERROR_NOT_FOUND:
            return
        name = symbol.decode()
        cu.check((err,), f"cuModuleGetGlobal({name})")
        if int(size) != len(data):
            raise RuntimeError(
                f"{name} in this module is {int(size)} bytes, expected {len(data)}: "
                "the module was built with another version of mori's device headers"
            )
        host = ctypes.create_string_buffer(data, len(data))
        cu.call("cuMemcpyHtoD", ptr, ctypes.addressof(host), len(data))

    def atomic(self, op: str, dest: int, pe: int, value: int, compare: int, width: int) -> int:
        """Runs one atomic on PE ``pe`` (symmetric ``dest``) and returns the old value."""
        self.ctx.make_current()
        result = self.heap.base + RESULT_OFFSET
        args = [
            ctypes.c_int(_OPS[op]),
            ctypes.c_int(width),
            ctypes.c_uint64(dest),
            ctypes.c_int(pe),
            ctypes.c_uint64(value),
            ctypes.c_uint64(compare),
            ctypes.c_uint64(result),
        ]
        launch(self._atomic, 1, 1, args)
        return int.from_bytes(self.heap.read(result, 8), "little") & ((1 << width) - 1)

    def barrier(self, stream: int) -> None:
        """Enqueues the device barrier on ``stream``."""
        self.ctx.make_current()
        launch(self._barrier, 1, 256, [], stream)

    def close(self) -> None:
        """Unloads the helper module."""
        self.ctx.make_current()
        cu.call("cuModuleUnload", self.module)
