"""What each driver call of a staged copy costs the CPU on this machine (cuda-bindings, one thread).

A staged copy queued by mori-core's Stager is a few driver calls: the context pushed and popped
around them (on a thread of the application's), the thread's capture mode exchanged twice, the
copy, then the write of the lane's word behind it. This times each call alone, ``--iters`` times
in a row, and prints the median CPU time per call in µs (Python's cost of a call through
cuda-bindings, measured on ``cuCtxGetCurrent``, is printed first: subtract it).

Usage: python ci/device/driver_call_probe.py [--iters 2000] [--sizes 4K,64K]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

from cuda.bindings import driver as cu


def _ok(result):  # noqa: ANN001, ANN202 - cuda-bindings returns (CUresult, *values)
    err = result[0] if isinstance(result, tuple) else result
    assert err == cu.CUresult.CUDA_SUCCESS, err
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


def _time(call, iters: int) -> float:  # noqa: ANN001
    samples = []
    for _ in range(iters):
        t = time.perf_counter_ns()
        call()
        samples.append(time.perf_counter_ns() - t)
    return statistics.median(samples) / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--sizes", default="4K,64K")
    a = p.parse_args()
    _ok(cu.cuInit(0))
    dev = _ok(cu.cuDeviceGet(0))
    ctx = _ok(cu.cuDevicePrimaryCtxRetain(dev))
    _ok(cu.cuCtxSetCurrent(ctx))
    stream = _ok(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
    biggest = max(int(s[:-1]) << 10 for s in a.sizes.split(","))
    dptr = _ok(cu.cuMemAlloc(biggest))
    host = _ok(cu.cuMemHostAlloc(biggest, 0))
    word = _ok(cu.cuMemHostAlloc(64, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE))
    word_dev = _ok(cu.cuMemHostGetDevicePointer(word, 0))
    n = a.iters

    def push_pop() -> None:
        cu.cuCtxPushCurrent(ctx)
        cu.cuCtxPopCurrent()

    def exchange() -> None:
        cu.cuThreadExchangeStreamCaptureMode(cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)

    rows = [
        ("cuCtxGetCurrent (Python's cost)", lambda: cu.cuCtxGetCurrent()),
        ("cuCtxPushCurrent + cuCtxPopCurrent", push_pop),
        ("cuThreadExchangeStreamCaptureMode", exchange),
        ("cuStreamQuery (idle)", lambda: cu.cuStreamQuery(stream)),
    ]
    for text in a.sizes.split(","):
        size = int(text[:-1]) << 10
        rows.append((f"cuMemcpyDtoHAsync {text}", lambda s=size: cu.cuMemcpyDtoHAsync(host, dptr, s, stream)))
        rows.append((f"cuMemcpyHtoDAsync {text}", lambda s=size: cu.cuMemcpyHtoDAsync(dptr, host, s, stream)))
    rows.append(("cuStreamWriteValue32", lambda: cu.cuStreamWriteValue32(stream, word_dev, 1, 0)))
    for what, call in rows:
        us = _time(call, n)
        _ok(cu.cuStreamSynchronize(stream))
        print(f"{what:>38}: {us:6.2f} us", flush=True)
    # A 4 KiB copy out and its word, then polling the word: the whole of a waited staged copy.
    samples = []
    view = ctypes.c_uint32.from_address(int(word))
    for i in range(n):
        t = time.perf_counter_ns()
        cu.cuMemcpyDtoHAsync(host, dptr, 4096, stream)
        cu.cuStreamWriteValue32(stream, word_dev, (i + 2) & 0xFFFFFFFF, 0)
        while view.value != ((i + 2) & 0xFFFFFFFF):
            pass
        samples.append(time.perf_counter_ns() - t)
    print(f"{'4K out + word, polled to its end':>38}: {statistics.median(samples) / 1e3:6.2f} us")


if __name__ == "__main__":
    main()
