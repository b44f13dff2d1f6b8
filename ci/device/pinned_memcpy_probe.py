"""Does this machine's CPU copy into and out of page-locked host memory as fast as pageable memory?

Every staged path (the TCP plane's sockets, UCX over tcp) has the CPU read or write the pinned
memory the copy engine uses. This times one thread's memcpy (numpy) of ``--bytes`` at a time,
medians of ``--iters``, in GB/s:

- into and out of one anonymous mapping while it is pageable, then after ``cudaHostRegister``
  made it page-locked, then after ``cudaHostUnregister`` (the same pages all along: whether
  locking them, not where they came from, changes the speed);
- into and out of memory from ``cudaHostAlloc`` (PyTorch's ``pin_memory=True``, as the staging
  pool's ``cuMemHostAlloc``).

Usage: python ci/device/pinned_memcpy_probe.py [--bytes 64M] [--iters 20]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np
import torch


def _gbs(dst: np.ndarray, src: np.ndarray, iters: int) -> float:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return dst.nbytes / statistics.median(times) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", default="64M")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    n = int(a.bytes[:-1]) << {"K": 10, "M": 20, "G": 30}[a.bytes[-1]]
    torch.empty(1, device="cuda")  # the process's CUDA context
    other = np.ones(n, dtype=np.uint8)  # pageable, touched
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    probe = np.frombuffer(m, dtype=np.uint8)
    probe[:] = 1
    cudart = torch.cuda.cudart()

    def row(what: str, buf: np.ndarray) -> None:
        print(f"{what:>34}: into {_gbs(buf, other, a.iters):6.2f} GB/s, out of {_gbs(other, buf, a.iters):6.2f}")

    row("mapping, pageable", probe)
    rc = cudart.cudaHostRegister(probe.ctypes.data, n, 0)
    assert int(rc) == 0, f"cudaHostRegister: {rc}"
    row("same mapping, cudaHostRegister", probe)
    rc = cudart.cudaHostUnregister(probe.ctypes.data)
    assert int(rc) == 0, f"cudaHostUnregister: {rc}"
    row("same mapping, unregistered again", probe)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    pinned[:] = 1
    row("cudaHostAlloc (pin_memory=True)", pinned)
    row("pageable (numpy)", np.ones(n, dtype=np.uint8))


if __name__ == "__main__":
    main()
