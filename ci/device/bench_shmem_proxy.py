"""mori.shmem through its remote transport: host-initiated against device-initiated (the device
proxy), run under torchrun --nproc_per_node=2 with MORI_DISABLE_P2P=ON (every peer remote, as on
another host; UCX_TLS decides the transport, tcp,cuda_copy here).

* put bandwidth, PE 0 into PE 1's heap, 4 KiB .. 64 MiB, from PE 0's heap: ``shmem_putmem``
  (host), and a kernel whose block issues ``ShmemPutMemNbiBlock`` then ``ShmemQuietBlock``
  (device, through the proxy), `reps` back to back;
* put+signal ping-pong, 8 bytes, one-way latency: host ``shmem_putmem_signal`` +
  ``shmem_wait_until`` on both PEs, and a one-thread kernel on each PE doing the same with
  ``ShmemPutMemNbiSignalThread`` + ``ShmemWaitUntil``. The kernel times its rounds itself with the
  GPU's global timer, from the end of its first tenth (a warm-up: the proxy and the peers' engines
  wake up) to its last round's answer, so that the launch, the two PEs' skew in starting their
  kernels and the final quiet (together ~4 ms on the H200 machine, 10 us a round of 200) are not
  counted as latency; the host's rounds are timed by the host's clock around its loop.

Wall-clock medians of `trials`, rounds alternating host and device. Prints a table on rank 0 and
writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import mori.shmem as shmem
from mori.core import cuda as cu

KERNELS = r"""
#define MORI_DEVICE_DEFINE_STATE
#include <mori/device/shmem.cuh>
using namespace mori::device;

extern "C" __global__ void put_bw(char* dest, const char* src, unsigned long long bytes, int pe, int reps) {
  for (int r = 0; r < reps; ++r) ShmemPutMemNbiBlock(dest, src, bytes, pe);
  ShmemQuietBlock();
}

// PE 0 starts: round i sends i and waits for the peer's i. clock[0]: the global timer when the
// first tenth of the rounds ended, clock[1]: when the last one did.
extern "C" __global__ void ping_pong(char* buf, uint64_t* sig, int iters, int me, uint64_t* clock) {
  const int peer = 1 - me;
  const int warm = iters / 10;
  clock[0] = ptx::GlobalTimerNs();
  for (int i = 1; i <= iters; ++i) {
    if (i == warm + 1) clock[0] = ptx::GlobalTimerNs();
    if (me == 0) {
      ShmemPutMemNbiSignalThread(buf, buf + 64, 8, sig, (uint64_t)i, kSignalSet, peer);
      ShmemWaitUntil<uint64_t>(sig, kCmpEq, (uint64_t)i);
    } else {
      ShmemWaitUntil<uint64_t>(sig, kCmpEq, (uint64_t)i);
      ShmemPutMemNbiSignalThread(buf, buf + 64, 8, sig, (uint64_t)i, kSignalSet, peer);
    }
  }
  clock[1] = ptx::GlobalTimerNs();
  ShmemQuietThread();
}
"""

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]


def reps(size: int) -> int:
    """Puts per timed round of ``size`` bytes: 50 small ones, fewer large ones (64 MiB once)."""
    return max(1, min(50, (256 << 20) // size // 4))


def launch(fn: object, grid: int, block: int, args: list[ctypes._SimpleCData]) -> None:
    """Launches ``fn`` on the default stream with ctypes-typed arguments (does not wait)."""
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    cu.call("cuLaunchKernel", fn, grid, 1, 1, block, 1, 1, 0, cu.driver().CUstream(0), ctypes.addressof(params), 0)


def _sync() -> None:
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()


class ProxyBench:
    """The kernels and buffers of one PE (collective: every PE makes one), and one timed round of
    each measurement; ``ci/shmem_remote_bench.py --device`` uses it between two network namespaces."""

    def __init__(self, max_bytes: int) -> None:
        self.me = shmem.shmem_mype()
        module = shmem.shmem_load_module(KERNELS, "bench_shmem_proxy.cu")
        self.put_bw = cu.call("cuModuleGetFunction", module, b"put_bw")
        # The device API's register use decides how many threads a block may have.
        attr = cu.driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
        self.block = min(1024, int(cu.call("cuFuncGetAttribute", attr, self.put_bw)))
        self.ping = cu.call("cuModuleGetFunction", module, b"ping_pong")
        self.big = shmem.shmem_tensor(max_bytes, torch.uint8)
        self.dst = shmem.shmem_tensor(max_bytes, torch.uint8)
        self.big.fill_(7)
        self.sig = shmem.shmem_tensor(1, torch.int64)
        self.buf = shmem.shmem_tensor(128, torch.uint8)
        self.clock = torch.zeros(2, dtype=torch.int64, device="cuda")

    def put(self, size: int, reps: int) -> tuple[float, float]:
        """Seconds per put of ``size`` bytes, PE 0 into PE 1: host ``shmem_putmem`` (the median of
        ``reps`` calls, each timed; the source view made once, as a caller's buffer) and the device
        kernel (the mean of its ``reps`` puts, one launch); (0, 0) on the other PE."""
        host = dev = 0.0
        _sync()
        if self.me == 0:
            src, dst, times = self.big[:size], self.dst.data_ptr(), []
            for _ in range(reps):
                t0 = time.perf_counter()
                shmem.shmem_putmem(dst, src, 1)
                times.append(time.perf_counter() - t0)
            host = statistics.median(times)
        _sync()
        if self.me == 0:
            t0 = time.perf_counter()
            launch(
                self.put_bw,
                1,
                self.block,
                [
                    ctypes.c_uint64(self.dst.data_ptr()),
                    ctypes.c_uint64(self.big.data_ptr()),
                    ctypes.c_uint64(size),
                    ctypes.c_int(1),
                    ctypes.c_int(reps),
                ],
            )
            cu.call("cuCtxSynchronize")
            dev = (time.perf_counter() - t0) / reps
        _sync()
        return host, dev

    def ping_pong(self, iters: int) -> tuple[float, float]:
        """One-way seconds of an 8-byte put+signal ping-pong: host calls, then a one-thread kernel on
        each PE (timed by the kernel, past its first tenth of the rounds: see the module's doc)."""
        sig, buf, me = self.sig, self.buf, self.me
        sig.zero_()
        _sync()
        t0 = time.perf_counter()
        for i in range(1, iters + 1):
            if me == 0:
                shmem.shmem_putmem_signal(buf.data_ptr(), buf[64:72], sig.data_ptr(), i, shmem.SHMEM_SIGNAL_SET, 1)
                shmem.shmem_wait_until(sig.data_ptr(), shmem.SHMEM_CMP_EQ, i)
            else:
                shmem.shmem_wait_until(sig.data_ptr(), shmem.SHMEM_CMP_EQ, i)
                shmem.shmem_putmem_signal(buf.data_ptr(), buf[64:72], sig.data_ptr(), i, shmem.SHMEM_SIGNAL_SET, 0)
        host = (time.perf_counter() - t0) / (2 * iters)
        sig.zero_()
        _sync()
        args = [ctypes.c_uint64(buf.data_ptr()), ctypes.c_uint64(sig.data_ptr()), ctypes.c_int(iters), ctypes.c_int(me)]
        launch(self.ping, 1, 1, [*args, ctypes.c_uint64(self.clock.data_ptr())])
        cu.call("cuCtxSynchronize")
        start, end = self.clock.tolist()
        dev = (end - start) / 1e9 / (2 * (iters - iters // 10))
        _sync()
        return host, dev

    def close(self) -> None:
        for t in (self.buf, self.sig, self.dst, self.big):
            shmem.shmem_free(t.data_ptr())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "bench_shmem_proxy.json"))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_world import init_world

    init_world()
    shmem.shmem_torch_process_group_init("default")
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    assert n == 2, "run with 2 PEs"
    bench = ProxyBench(max(SIZES))
    results: dict[str, list[dict[str, float]]] = {"put": [], "latency": []}
    for size in SIZES:
        times = [bench.put(size, reps(size)) for _ in range(args.trials)]
        host_t, dev_t = [t[0] for t in times], [t[1] for t in times]
        row = {
            "bytes": size,
            "host_gbps": size / statistics.median(host_t) / 1e9 if me == 0 else 0.0,
            "device_gbps": size / statistics.median(dev_t) / 1e9 if me == 0 else 0.0,
        }
        results["put"].append(row)
    lat = [bench.ping_pong(args.iters) for _ in range(args.trials)]
    results["latency"].append(
        {
            "bytes": 8,
            "host_us": statistics.median(t[0] for t in lat) * 1e6,
            "device_us": statistics.median(t[1] for t in lat) * 1e6,
        }
    )
    if me == 0:
        print(
            f"mori.shmem remote put bandwidth, PE 0 -> PE 1 (MORI_DISABLE_P2P, UCX_TLS={os.environ.get('UCX_TLS')}), "
            f"median of {args.trials}"
        )
        print(f"{'size':>10} {'host GB/s':>10} {'device GB/s':>12} {'device/host':>12}")
        for r in results["put"]:
            print(
                f"{r['bytes']:>10} {r['host_gbps']:>10.3f} {r['device_gbps']:>12.3f} "
                f"{r['device_gbps'] / r['host_gbps']:>11.0%}"
            )
        lat0 = results["latency"][0]
        print(f"put+signal ping-pong, 8 B, one way: host {lat0['host_us']:.1f} us, device {lat0['device_us']:.1f} us")
        Path(args.out).write_text(json.dumps(results, indent=1))
    bench.close()
    shmem.shmem_finalize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
