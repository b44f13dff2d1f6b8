"""What one signal put costs at a target whose words are GPU memory, step by step, so that a
device put+signal's one-way time can be split between the wire and the GPU's part.

One process, two UCX engines (initiator ``a``, target ``b``, UCX over loopback), ``b`` serving
GPU words as mori.shmem's transport does (:func:`mori.core.ucx_atomic.serve_gpu`). Medians of
``--iters``, µs:

- ``signal put, host word``: an 8-byte signal put whose bytes and word are host memory (the wire
  and both engines' threads, the reference);
- ``signal put, GPU word``: the same into a CUDA VMM allocation (the target copies the bytes in,
  writes the word, and waits for its stream before answering);
- ``  seen by a kernel``: the same, with a one-thread kernel spinning on the word, which answers
  each value into host-mapped memory; the share of calls whose answer was already there when the
  signal put returned, and the median time to it from the call;
- the target's driver steps alone, from Python on a stream of a context of its own (each includes
  ~1 µs of Python per call): ``cuStreamQuery`` (the floor), an 8-byte ``cuMemcpyHtoDAsync`` +
  synchronize, ``cuStreamWriteValue64`` + synchronize, both + synchronize, and two 64-bit writes
  in one ``cuStreamBatchMemOp`` + synchronize.

Usage: python ci/device/signal_probe.py [--iters 2000]   (under MPS or not: run it both ways)
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

from mori.core import cuda, nvrtc, ucx
from mori.core.memory.cuda_vmm import VmmAllocation
from mori.core.ucx_atomic import HOST_MAPPED, serve_gpu, signal_put

WATCH = r"""
extern "C" __global__ void watch(volatile unsigned long long* word, volatile unsigned long long* seen, int n) {
  for (int i = 1; i <= n; ++i) {
    while (*word != (unsigned long long)i) {}
    *seen = i;
    __threadfence_system();
  }
}
"""


def median_us(step: Callable[[int], None], iters: int) -> float:
    for i in range(1, 20):
        step(i)
    times = []
    for i in range(1, iters + 1):
        t = time.perf_counter_ns()
        step(i)
        times.append(time.perf_counter_ns() - t)
    return statistics.median(times) / 1e3


def driver_steps(iters: int, dev_addr: int, arch: str) -> dict[str, float]:
    drv = cuda.driver()
    ctx = cuda.create_context(cuda.call("cuCtxGetDevice"))
    stream = cuda.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
    bounce = int(cuda.call("cuMemHostAlloc", 64, HOST_MAPPED))

    def sync() -> None:
        cuda.call("cuStreamSynchronize", stream)

    def copy(i: int) -> None:
        cuda.call("cuMemcpyHtoDAsync", dev_addr + 64, bounce, 8, stream)
        sync()

    def write(i: int) -> None:
        cuda.call("cuStreamWriteValue64", stream, dev_addr, i, 0)
        sync()

    def both(i: int) -> None:
        cuda.call("cuMemcpyHtoDAsync", dev_addr + 64, bounce, 8, stream)
        cuda.call("cuStreamWriteValue64", stream, dev_addr, i, 0)
        sync()

    ops = [drv.CUstreamBatchMemOpParams() for _ in range(2)]
    for k, p in enumerate(ops):
        p.writeValue.operation = drv.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64
        p.writeValue.address = dev_addr + 64 * (1 - k)
        p.writeValue.flags = 0

    def batch(i: int) -> None:
        for p in ops:
            p.writeValue.value64 = i
        cuda.call("cuStreamBatchMemOp", stream, 2, ops, 0)
        sync()

    out = {"cuStreamQuery (floor)": median_us(lambda i: cuda.call("cuStreamQuery", stream), iters)}
    for name, step in (
        ("HtoD 8 B + sync", copy),
        ("writeValue64 + sync", write),
        ("HtoD + writeValue64 + sync", both),
        ("batchMemOp 2 writes + sync", batch),
    ):
        try:
            out[name] = median_us(step, iters)
        except Exception as err:  # noqa: BLE001 - a probe reports what the driver refused
            print(f"{name}: {type(err).__name__}: {err}")
    cuda.call("cuCtxDestroy", ctx)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=2000)
    args = parser.parse_args()
    ctx = cuda.init_device(0)
    major, minor = torch.cuda.get_device_capability(0)
    arch = f"sm_{major}{minor}"
    a = ucx.make_engine("probe-a", timeout=10.0)
    b = ucx.make_engine("probe-b", timeout=10.0)
    host = (ctypes.c_uint64 * 16)()
    b.register_memory(1, ctypes.addressof(host), ctypes.sizeof(host))
    alloc = VmmAllocation.create(2 << 20, 0)
    words = serve_gpu(b, ctx, arch)
    b.register_memory(2, alloc.ptr, 2 << 20, True)
    peer = a.connect("b", b.addresses, b.admit("a"))
    src = ctypes.c_uint64(7)
    src_addr = ctypes.addressof(src)
    res: dict[str, float] = {}
    res["signal put, host word"] = median_us(
        lambda i: signal_put(a, peer, 1, 64, src_addr, 8, 1, 0, "store", i), args.iters
    )
    res["signal put, GPU word"] = median_us(
        lambda i: signal_put(a, peer, 2, 64, src_addr, 8, 2, 0, "store", i), args.iters
    )

    # A kernel on the word: when does it see each value, against the call's return?
    cuda.call("cuCtxSetCurrent", ctx)
    cuda.call("cuMemsetD8", alloc.ptr, 0, 64)
    module = cuda.call("cuModuleLoadData", nvrtc.compile(WATCH, name="watch.cu", arch=arch, output="cubin"))
    fn = cuda.call("cuModuleGetFunction", module, b"watch")
    seen_host = int(cuda.call("cuMemHostAlloc", 8, HOST_MAPPED))
    seen = ctypes.c_uint64.from_address(seen_host)
    seen.value = 0
    seen_dev = int(cuda.call("cuMemHostGetDevicePointer", seen_host, 0))
    n = args.iters
    params = [ctypes.c_uint64(alloc.ptr), ctypes.c_uint64(seen_dev), ctypes.c_int(n)]
    argv = (ctypes.c_void_p * 3)(*[ctypes.addressof(p) for p in params])
    stream = cuda.call("cuStreamCreate", cuda.driver().CUstream_flags.CU_STREAM_NON_BLOCKING)
    cuda.call("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, stream, ctypes.addressof(argv), 0)
    calls, to_seen, early = [], [], 0
    for i in range(1, n + 1):
        t = time.perf_counter_ns()
        signal_put(a, peer, 2, 64, src_addr, 8, 2, 0, "store", i)
        t1 = time.perf_counter_ns()
        early += seen.value == i
        deadline = time.monotonic() + 5
        while seen.value != i:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel never saw value {i} (it saw {seen.value})")
        t2 = time.perf_counter_ns()
        calls.append(t1 - t)
        to_seen.append(t2 - t)
    cuda.call("cuStreamSynchronize", stream)
    res["  with a kernel spinning on it"] = statistics.median(calls) / 1e3
    res["  seen by the kernel, from the call"] = statistics.median(to_seen) / 1e3
    print(f"kernel saw the value before the call returned in {100 * early / n:.0f} % of {n} calls")
    res.update(driver_steps(args.iters, alloc.ptr, arch))
    for k, v in res.items():
        print(f"{k:40s} {v:8.1f} us")
    peer.close()
    words.close()
    a.close()
    b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
