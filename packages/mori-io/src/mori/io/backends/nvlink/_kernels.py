"""The gather/scatter kernel of the NVLink backend: many small blocks in one launch.

A batch of thousands of small blocks costs thousands of copy-engine commands; one kernel launch
with a table of ``(src, dst, bytes)`` rows in device memory moves them all. Rows are cut into
pieces in the kernel; a warp copies one piece at a time (pieces striped over all warps of the
grid, which is as large as the GPU holds at once) with mori's device copy routine
(``mori::device::GroupCopy``: 16-byte vectors when the pointers are congruent modulo
16, eight loads in flight per thread to hide NVLink latency). Pointers may be local or peer
(IPC-opened / VMM-imported) addresses: the SMs of the initiator's GPU load and store across
NVLink directly.

The kernel is compiled once per architecture by NVRTC (cached on disk by ``mori.core.nvrtc``)
and loaded once per device. Tables are pinned host blocks of a ``PinnedPool`` with device twins.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from mori.core import cuda as _cuda
from mori.core import nvrtc
from mori.core.gpu import GatherLauncher
from mori.core.memory import PinnedPool, pinned_alloc, pinned_free

__all__ = ["KERNEL_SOURCE", "KERNEL_NAME", "ROW_WORDS", "CopyKernel", "TableBuffer", "TablePool"]

KERNEL_NAME = "mori_io_gather_copy"
ROW_WORDS = 3  # a table row: src, dst, bytes (uint64 each)
_THREADS = 512  # 16 warps per block
# A lone block is cut into pieces of this size, one per warp: a warp moves 4 KiB in one unrolled
# step of GroupCopy (32 lanes x 8 x 16 bytes), so every piece is a single NVLink round trip.
_SINGLE_PIECE = 4096

KERNEL_SOURCE = r"""
#include <mori/device/copy.cuh>

// Work item i is piece i % per_row (of `piece` bytes) of row i / per_row; one warp per item.
// rows: {src, dst, bytes} each. Rows are cut here rather than on the host because a host pass
// over thousands of pieces costs more than the copy of a 256 MiB batch takes to start; items past
// the end of a shorter row are skipped. When rows is null there is one row, passed by value (a
// one-block transfer needs no table upload).
extern "C" __global__ void __launch_bounds__(512)
mori_io_gather_copy(const unsigned long long* rows, unsigned long long items, unsigned long long per_row,
                    unsigned long long piece, unsigned long long src0, unsigned long long dst0,
                    unsigned long long bytes0) {
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned long long warp = (static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const unsigned long long warps = (static_cast<unsigned long long>(gridDim.x) * blockDim.x) >> 5;
  for (unsigned long long i = warp; i < items; i += warps) {
    const unsigned long long row = per_row == 1 ? i : i / per_row;
    const unsigned long long off = (i - row * per_row) * piece;
    unsigned long long src = src0, dst = dst0, bytes = bytes0;
    if (rows != nullptr) {
      src = rows[3 * row];
      dst = rows[3 * row + 1];
      bytes = rows[3 * row + 2];
    }
    if (off >= bytes) continue;
    bytes = bytes - off < piece ? bytes - off : piece;
    mori::device::GroupCopy(reinterpret_cast<void*>(dst + off), reinterpret_cast<const void*>(src + off),
                                    bytes, lane, 32u);
  }
}
"""


def compile_cubin(arch: str) -> bytes:
    """The kernel compiled for ``arch`` (e.g. ``sm_90``); NVRTC needs no GPU."""
    return nvrtc.compile(KERNEL_SOURCE, name="mori_io_gather_copy.cu", arch=arch, output="cubin")


@dataclass
class TableBuffer:
    """A pinned host table and its device twin, ``capacity`` rows each."""

    capacity: int
    host_ptr: int
    dev_ptr: int
    rows: np.ndarray  # (capacity, ROW_WORDS) uint64 view of the host buffer


class TablePool:
    """Table buffers of one device, reused once the transfer that used them completes.

    The host tables are blocks of a :class:`mori.core.memory.PinnedPool` (at most ``keep`` idle
    of each capacity); each block's device twin is allocated and freed with it. Capacities are
    powers of two so a buffer fits many batch sizes. Use with the device's context current.
    """

    def __init__(self, device: int, keep: int = 8) -> None:
        self._device = device
        self._buffers: dict[int, TableBuffer] = {}  # host address -> its buffer (twin, row view)
        self._pinned = PinnedPool(
            max_idle=keep, name=f"copy tables of device {device}", alloc=self._alloc, free=self._free
        )

    def _alloc(self, nbytes: int) -> int:
        host = pinned_alloc(nbytes)
        try:
            dev = int(_cuda.call("cuMemAlloc", nbytes, detail=f"{nbytes}-byte copy table on device {self._device}"))
        except BaseException:
            pinned_free(host)
            raise
        cap = nbytes // (ROW_WORDS * 8)
        view = np.ctypeslib.as_array((ctypes.c_uint64 * (cap * ROW_WORDS)).from_address(host))
        self._buffers[host] = TableBuffer(cap, host, dev, view.reshape(cap, ROW_WORDS))
        return host

    def _free(self, host: int) -> None:
        buf = self._buffers.pop(host)
        _cuda.call("cuMemFree", buf.dev_ptr)
        pinned_free(host)

    def take(self, rows: int) -> TableBuffer:
        """A buffer of at least ``rows`` rows (allocated when none is idle)."""
        cap = max(64, 1 << (rows - 1).bit_length())
        host = self._pinned.try_acquire(cap * ROW_WORDS * 8)
        assert host is not None  # the pool has no limit
        return self._buffers[host]

    def give(self, buf: TableBuffer) -> None:
        """Returns a buffer whose transfer has completed."""
        self._pinned.release(buf.host_ptr)

    def close(self) -> None:
        """Frees every idle buffer (the device's context must be current)."""
        self._pinned.close()


class CopyKernel:
    """The gather/scatter kernel loaded on one device (whose primary context is current)."""

    def __init__(self, device: int) -> None:
        self.device = device
        drv = _cuda.driver()
        dev = _cuda.call("cuDeviceGet", device)
        attr = drv.CUdevice_attribute
        major = int(_cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
        minor = int(_cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
        sms = int(_cuda.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev))
        cubin = compile_cubin(f"sm_{major}{minor}")
        self._module = _cuda.call("cuModuleLoadData", cubin, detail=f"copy kernel on device {device}")
        function = _cuda.call("cuModuleGetFunction", self._module, KERNEL_NAME.encode())
        # Pieces are striped over the warps of the grid: a grid of exactly the blocks that can be
        # resident at once keeps every warp busy with no second wave.
        per_sm = int(_cuda.call("cuOccupancyMaxActiveBlocksPerMultiprocessor", function, _THREADS, 0))
        # Upload, launch and event record happen in native code (one Python call per transfer
        # instead of three driver calls through the bindings and the argument packing).
        self._launcher = GatherLauncher(
            _cuda.entry_point("cuLaunchKernel"),
            _cuda.entry_point("cuMemcpyHtoDAsync"),
            _cuda.entry_point("cuEventRecord"),
            int(function),
            _THREADS,
            sms * max(1, per_sm),
        )
        self._result = drv.CUresult
        self.tables = TablePool(device)

    def grid(self, warps: int) -> int:
        """Thread blocks for ``warps`` busy warps, at most what the GPU holds at once."""
        return int(self._launcher.grid(warps))

    def launch(
        self,
        stream: Any,
        table: TableBuffer | None,
        rows: int,
        per_row: int = 1,
        piece: int = 0,
        single: tuple[int, int, int] = (0, 0, 0),
        event: Any = None,
    ) -> None:
        """Copies ``rows`` rows of ``table`` (uploaded on ``stream`` first: no host wait), each cut
        into ``per_row`` pieces of ``piece`` bytes, or the one block ``single`` = (src, dst, bytes)
        when ``table`` is None (``rows``, ``per_row`` and ``piece`` are ignored then), then records
        ``event`` if given; asynchronous on ``stream``."""
        host, dev = (table.host_ptr, table.dev_ptr) if table is not None else (0, 0)
        code, failed = self._launcher.launch(
            int(stream),
            host,
            dev,
            rows if table is not None else 0,
            per_row,
            piece,
            *single,
            _SINGLE_PIECE,
            0 if event is None else int(event),
        )
        if code:  # the message is built only on failure: this is the per-transfer path
            _cuda.check((self._result(code),), failed, f"{rows}-row copy on device {self.device}")

    def close(self) -> None:
        """Unloads the module and frees idle tables (the device's context must be current)."""
        self.tables.close()
        _cuda.call("cuModuleUnload", self._module)
