"""The NVLink backend's host path on a machine without a GPU: what one ``batch_read`` costs the
host before and after its copies, with every CUDA driver call answered at once.

A stand-in driver (below) answers the calls the backend makes (streams, events, the table pool,
the gather kernel's launch) without a GPU and without copying a byte: every event has fired when
it is first asked about. Two engines in this process (initiator and target, with the real
control plane between them) then run the calls ``ci/device/io_bench.py`` times, with the same
arguments (numpy offsets; ``scatter`` = remote blocks in reverse order): the median from the call
to the return of ``Wait()`` is the host's share of a transfer, the part that adds to the copy's
own time on a GPU. Beside it: the engine's build of the batch, and the backend's plan of it, with
a table of its own (``plan_batch``: a pass over the rows) and in place (``plan_in_place``: the
kernel reads the rows the engine built into the table it lent). ``--profile`` prints cProfile's
top functions of the first point.

Usage: python packages/mori-io/tests/nvlink_host_bench.py [--iters 2000] [--profile] [--driver 12080]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from mori.core import cuda as _cuda
from mori.core import gpu as _gpu
from mori.core.host import this_host
from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryLocationType, XgmiBackendConfig
from mori.io._transfers import _batch
from mori.io.backends.nvlink import _exports, _kernels, _remote_regions
from mori.io.backends.nvlink import backend as nvlink
from mori.io.backends.nvlink.plan import plan_batch, plan_in_place

POOL = 512 << 20
POINTS = [
    (4 << 10, 16384, "scatter"),
    (4 << 10, 16384, "contig"),
    (256 << 10, 1024, "scatter"),
    (4 << 10, 16, "scatter"),
]


class _Enum(SimpleNamespace):
    def __getattr__(self, name: str) -> Any:  # any member: its value is never read by the driver
        return SimpleNamespace(value=0, name=name)


class StandInDriver:
    """``cuda.bindings.driver`` as far as the NVLink backend's transfer path uses it: every call
    succeeds at once; handles are ints; pinned host memory is numpy memory kept here."""

    CUresult = int
    CU_MEMHOSTALLOC_PORTABLE = 0
    CUstream_flags = _Enum()
    CUevent_flags = _Enum()
    CUdevice_attribute = _Enum()
    CUdriverProcAddress_flags = _Enum()

    def __init__(self, version: int) -> None:
        self._version = version
        self._handles = itertools.count(1)
        self._host: dict[int, np.ndarray] = {}

    def _new(self, *_: Any) -> tuple[int, int]:
        return 0, next(self._handles)

    def _ok(self, *_: Any) -> tuple[int]:
        return (0,)

    cuInit = cuCtxSetCurrent = cuCtxSynchronize = cuStreamQuery = cuStreamSynchronize = _ok
    cuStreamDestroy = cuEventRecord = cuEventQuery = cuEventDestroy = cuMemFree = cuModuleUnload = _ok
    cuDeviceGet = cuDevicePrimaryCtxRetain = cuStreamCreate = cuEventCreate = cuMemAlloc = _new
    cuModuleLoadData = cuModuleGetFunction = _new

    def cuGetProcAddress(self, *_: Any) -> tuple[int, int, int]:
        return 0, next(self._handles), 0

    def cuDeviceGetCount(self) -> tuple[int, int]:
        return 0, 2

    def cuDeviceGetPCIBusId(self, _n: int, device: int) -> tuple[int, bytes]:
        return 0, f"0000:{device:02x}:00.0".encode()

    def cuDeviceGetAttribute(self, *_: Any) -> tuple[int, int]:
        return 0, 9  # compute capability 9.x, 9 SMs: numbers the launch only reads

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, *_: Any) -> tuple[int, int]:
        return 0, 4

    def cuDriverGetVersion(self) -> tuple[int, int]:
        return 0, self._version

    def cuMemcpyAsync(self, *_: Any) -> tuple[int]:
        return (0,)

    def cuMemHostAlloc(self, nbytes: int, _flags: int) -> tuple[int, int]:
        buf = np.empty(nbytes, dtype=np.uint8)
        self._host[buf.ctypes.data] = buf
        return 0, buf.ctypes.data

    def cuMemFreeHost(self, addr: int) -> tuple[int]:
        self._host.pop(addr, None)
        return (0,)


class StandInLauncher:
    """``GatherLauncher`` without a GPU: checks its arguments' shape, launches nothing."""

    def __init__(self, *args: Any) -> None:
        self._max_blocks = args[-1]

    def grid(self, warps: int) -> int:
        return max(1, min(-(-warps // 16), self._max_blocks))

    def launch(self, stream: int, host: int, dev: int, rows: int, *rest: Any) -> tuple[int, str]:
        return 0, ""


def _stand_in(version: int) -> None:
    """Replaces the driver (of CUDA ``version``) and the GPU-only pieces (export, mapping, kernel,
    and from CUDA 13 the batched copy-engine call) of the backend."""
    drv = StandInDriver(version)
    _cuda.driver = lambda: drv  # type: ignore[assignment,return-value]
    if version >= 13000:  # cuMemcpyBatchAsync: one call queues a stream's copies
        _gpu.BatchMemcpy.try_queue = lambda self, dsts, srcs, sizes, stream, detail="": len(sizes) > 1  # type: ignore[method-assign]
    host = this_host().key

    def export(ptr: int, size: int, device: int) -> Any:
        return SimpleNamespace(info={"host": host, "pid": -1, "offset": 0, "kind": "ipc"}, fd=-1, close=lambda: None)

    _exports.export_region = export  # type: ignore[assignment]
    _remote_regions.open_mapping = lambda info, data, device, fd: SimpleNamespace(base=data, close=lambda: None)  # type: ignore[assignment,misc]
    _kernels.compile_cubin = lambda arch: b""  # type: ignore[assignment]
    _kernels.GatherLauncher = StandInLauncher  # type: ignore[assignment,misc]


def _layout(size: int, batch: int, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    local = np.arange(batch, dtype=np.int64) * size
    remote = local if layout == "contig" else local[::-1].copy()
    return local, remote, np.full(batch, size, dtype=np.int64)


def _median_us(fn: Any, iters: int) -> float:
    for _ in range(min(iters, 50)):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _plans(rows: Any, iters: int) -> tuple[float, str]:
    """Median microseconds of a read's plan_batch (into a table of its own) and plan_in_place
    ("-" where it declines), the remote region mapped at 2^40, the backend's settings."""
    out = np.empty((len(rows), 3), dtype=np.uint64)
    std = (nvlink.STRIPE, nvlink.ENGINE_STREAMS, out, nvlink.ENGINE_SHARE)
    plan = _median_us(lambda: plan_batch(rows, 1 << 40, True, 1 << 20, *std), iters)
    if plan_in_place(rows, 1 << 40, True, 1 << 20, nvlink.ENGINE_SHARE) is None:
        return plan, "-"
    return plan, f"{_median_us(lambda: plan_in_place(rows, 1 << 40, True, 1 << 20, nvlink.ENGINE_SHARE), iters):.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--driver", type=int, default=13000, help="CUDA driver version to stand in for (below 13000: no batched copies)"
    )
    args = ap.parse_args()
    _stand_in(args.driver)
    local_pool, remote_pool = np.empty(POOL, dtype=np.uint8), np.empty(POOL, dtype=np.uint8)
    with (
        IOEngine("host-target", IOEngineConfig(host="127.0.0.1", port=0)) as target,
        IOEngine("host-initiator", IOEngineConfig(host="127.0.0.1", port=0)) as engine,
    ):
        for e in (target, engine):
            e.create_backend(BackendType.XGMI, XgmiBackendConfig())
        engine.register_remote_engine(target.get_engine_desc())
        rdesc = target.register_memory(remote_pool.ctypes.data, POOL, 0, MemoryLocationType.GPU)
        ldesc = engine.register_memory(local_pool.ctypes.data, POOL, 1, MemoryLocationType.GPU)

        def read(l_offs: Any, r_offs: Any, sizes: Any) -> None:
            st = engine.batch_read(ldesc, l_offs, rdesc, r_offs, sizes, engine.allocate_transfer_uid())
            st.Wait()
            if not st.Succeeded():
                raise RuntimeError(st.Message())

        print(
            f"{'point':22} {'batch_read+Wait':>16} {'Batch build':>12} {'plan_batch':>11} {'plan_in_place':>14}"
            "   (us, median; in place: - where it declines)"
        )
        for i, (size, batch, layout) in enumerate(POINTS):
            cols = _layout(size, batch, layout)
            if args.profile and i == 0:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.iters):
                    read(*cols)
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
            whole = _median_us(lambda c=cols: read(*c), args.iters)
            built = _batch(ldesc.data, *cols)
            assert not isinstance(built, str)
            rows = built[0]
            build = _median_us(lambda c=cols: _batch(ldesc.data, *c), args.iters)
            plan, in_place = _plans(rows, args.iters)
            name = f"{batch} x {size >> 10}K {layout}"
            print(f"{name:22} {whole:16.1f} {build:12.1f} {plan:11.1f} {in_place:>14}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
