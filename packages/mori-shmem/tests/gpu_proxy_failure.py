"""A dead PE seen through the device proxy (2 PEs under torchrun, MORI_DISABLE_P2P=ON; see
test_gpu.py): PE 1 leaves after a barrier; PE 0's kernel puts to it through the proxy, and then
(1) the host's shmem_quiet raises ShmemError naming PE 1 within MORI_SHMEM_TIMEOUT, and (2) a
kernel whose quiet waits on the proxy fails its launch with a device report naming PE 1, instead
of hanging. Prints one line per check on PE 0."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import torch
from gpu_world import init_world

import mori.shmem as shmem
from mori.core import config
from mori.core import cuda as cu

KERNEL = r"""
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
using namespace mori::device;
extern "C" __global__ void put_then(char* dest, const char* src, unsigned long long bytes, int pe, int quiet) {
  ShmemPutMemNbiThread(dest, src, bytes, pe);
  if (quiet) ShmemQuietThread();
}
"""


def launch(fn: object, *args: ctypes._SimpleCData) -> None:
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    cu.call("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, cu.driver().CUstream(0), ctypes.addressof(params), 0)
    cu.call("cuCtxSynchronize")


def main() -> int:
    init_world()
    shmem.shmem_torch_process_group_init("default")
    me = shmem.shmem_mype()
    fn = cu.call("cuModuleGetFunction", shmem.shmem_load_module(KERNEL, "proxy_failure.cu"), b"put_then")
    buf = shmem.shmem_tensor(8192, torch.uint8)
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()
    if me == 1:
        os._exit(0)  # gone without finalize: its engine and endpoints die with it
    time.sleep(1.0)
    args = (
        ctypes.c_uint64(buf.data_ptr()),
        ctypes.c_uint64(buf.data_ptr() + 4096),
        ctypes.c_uint64(4096),
        ctypes.c_int(1),
    )
    launch(fn, *args, ctypes.c_int(0))  # posts the put and ends
    limit = config.get("MORI_SHMEM_TIMEOUT") + 5.0
    t0 = time.monotonic()
    try:
        shmem.shmem_quiet()
    except shmem.ShmemError as exc:
        took = time.monotonic() - t0
        assert "PE 1" in str(exc) and took < limit, (took, str(exc))
        print(f"ok  host shmem_quiet names the dead PE after {took:.2f} s: {exc}", flush=True)
    else:
        raise AssertionError("shmem_quiet returned although the put's PE is dead")
    t0 = time.monotonic()
    try:
        launch(fn, *args, ctypes.c_int(1))
    except cu.CudaError as exc:
        print(f"ok  a kernel's quiet failed its launch after {time.monotonic() - t0:.2f} s ({exc})", flush=True)
    else:
        raise AssertionError("the kernel's quiet returned although the put's PE is dead")
    ctypes.CDLL(None).fflush(None)  # the device's report sits in C's stdout buffer; _exit skips its flush
    os._exit(0)  # no finalize: its barrier would wait for the dead PE


if __name__ == "__main__":
    sys.exit(main())
