"""Variants of the NVLink backend's gather kernel, timed on the acceptance points in one run.

The SMs of GPU 0 copy a table of ``(src, dst, bytes)`` rows between GPU 0 and GPU 1 (peer access
enabled): ``read`` pulls from GPU 1 into GPU 0, ``write`` pushes from GPU 0 into GPU 1. Points:
16384 x 4 KiB and 1024 x 256 KiB, ``scat`` (the remote blocks in reverse order, one row each)
and ``cont`` (one row of all the bytes, as the backend merges a contiguous batch). The copy
engine's peer copy of one 256 MiB block (``cuMemcpyAsync``) is timed in the same run.

Every variant is one ``extern "C"`` instance of one kernel template, all compiled by one NVRTC
call (``mori.core.nvrtc``). Knobs (the ``Variant`` fields):

- ``group``: threads that copy one work item: 8, 16 or 32 lanes of a warp, or 0 = the whole block;
- ``unroll``: 16-byte loads each thread issues before its first store (a 32-lane group with unroll
  8 moves 4 KiB in one step; 16 lanes need unroll 16 for that);
- ``load``: plain, ``ld.global.nc.L1::no_allocate`` (nc), ``ld.volatile`` (vol), nc with the
  ``L2::256B`` prefetch hint (l2p); ``store``: plain, ``st.global.cs`` (cs),
  ``st.global.L1::no_allocate`` (na), ``st.global`` (g: no generic address);
- ``table``: every lane loads the row (t0, the current kernel), lanes 0-2 load one word each with
  ``ld.global.nc`` and share them by shuffle (t1), t1 with the next item's row loaded before the
  current item is copied and shared after it (pf), t0 loaded that early (pf0);
- ``sched``: static striding over groups (st) or an atomic work counter (at; zeroed by a memset
  inside the timed region; each claim is made one item ahead, so no copy waits for it);
- ``copy``: the sweep's vector copy, or mori's ``GroupCopy`` (the current kernel: ``base``);
- ``threads``, ``bpsm`` (blocks per SM; 0 = as many as fit), ``piece`` (bytes of a 256 KiB row
  one item covers), ``host`` (the table in pinned host memory, read by the kernel over PCIe: no
  upload).

Each cell is the median of ``--iters`` CUDA-event-timed launches (kernel only: the table is
already on the GPU, except ``upload`` which times the backend's per-transfer table upload). The
destination is zeroed before a variant runs and compared with the expected bytes after:
``FAIL`` instead of a number when they differ (a failing variant does not stop the run).

Usage (from the repository root, two GPUs): python3 ci/device/gather_sweep.py [--iters 15] [--budget 75]
[--only NAME,...]; ``--compile sm_90`` and ``--source`` need no GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from mori.core import cuda as cu
from mori.core import nvrtc

KERNEL_TEMPLATE = r"""
#include <mori/device/copy.cuh>

typedef unsigned long long u64;

template <int LOAD>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  uint4 v;
  if (LOAD == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if (LOAD == 2) {
    asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else if (LOAD == 3) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  } else {
    v = *p;
  }
  return v;
}

template <int STORE>
__device__ __forceinline__ void store16(uint4* p, const uint4& v) {
  if (STORE == 1) {
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else if (STORE == 2) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};"
                 :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else if (STORE == 3) {
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else {
    *p = v;
  }
}

// rank of size threads copy bytes; 16-byte vectors when both pointers are 16-aligned, else GroupCopy.
template <int COPY, int U, int LOAD, int STORE>
__device__ __forceinline__ void copy_piece(u64 dst, u64 src, u64 bytes, unsigned rank, unsigned size) {
  if (COPY == 1 || ((dst | src) & 15) != 0) {
    mori::device::GroupCopy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, rank, size);
    return;
  }
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(dst);
  const u64 n = bytes >> 4;
  u64 i = rank;
  for (; i + (U - 1) * (u64)size < n; i += (u64)size * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load16<LOAD>(s + i + u * (u64)size);
#pragma unroll
    for (int u = 0; u < U; ++u) store16<STORE>(d + i + u * (u64)size, v[u]);
  }
  for (; i < n; i += size) store16<STORE>(d + i, load16<LOAD>(s + i));
  for (u64 b = (n << 4) + rank; b < bytes; b += size)
    reinterpret_cast<char*>(dst)[b] = reinterpret_cast<const char*>(src)[b];
}

struct Item {
  u64 src, dst, bytes;  // bytes == 0: the piece is past its row's end
};

struct Raw {
  u64 a, b, c;  // a row's words: all three, or (TABLE 1, 2) this lane's one (lanes 0-2)
};

__device__ __forceinline__ u64 ld_nc64(const u64* p) {
  u64 v;
  asm volatile("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

template <int G>
__device__ __forceinline__ unsigned group_mask() {
  const unsigned lane = threadIdx.x & 31u;
  return G == 32 ? 0xffffffffu : (((1u << G) - 1u) << (lane / G * G));
}

// Issues the loads of item i's row; nothing waits for them until decode().
template <int G, int TABLE>
__device__ __forceinline__ Raw load_row(const u64* rows, u64 i, u64 per_row, unsigned rank) {
  const u64 row = per_row == 1 ? i : i / per_row;
  Raw r{0, 0, 0};
  if (G != 0 && (TABLE == 1 || TABLE == 2)) {
    if (rank < 3) r.a = ld_nc64(rows + 3 * row + rank);
  } else {
    r.a = rows[3 * row];
    r.b = rows[3 * row + 1];
    r.c = rows[3 * row + 2];
  }
  return r;
}

// Item i from its row's words (shared by shuffle when three lanes loaded them), clipped to its piece.
template <int G, int TABLE>
__device__ __forceinline__ Item decode(Raw r, u64 i, u64 per_row, u64 piece) {
  if (G != 0 && (TABLE == 1 || TABLE == 2)) {
    const unsigned m = group_mask<G>();
    const u64 w = r.a;
    r.a = __shfl_sync(m, w, 0, G);
    r.b = __shfl_sync(m, w, 1, G);
    r.c = __shfl_sync(m, w, 2, G);
  }
  const u64 row = per_row == 1 ? i : i / per_row;
  const u64 off = (i - row * per_row) * piece;
  Item it{r.a, r.b, r.c};
  if (off >= it.bytes) {
    it.bytes = 0;
  } else {
    it.bytes = it.bytes - off < piece ? it.bytes - off : piece;
    it.src += off;
    it.dst += off;
  }
  return it;
}

// The leader's atomicAdd on the work counter: its result is used one item later (no wait now).
__device__ __forceinline__ u64 claim(u64* counter, unsigned rank) { return rank == 0 ? atomicAdd(counter, 1ull) : 0; }

// The leader's value to the whole group.
template <int G>
__device__ __forceinline__ u64 share(u64 v, u64* slot) {
  if (G == 0) {
    if (threadIdx.x == 0) *slot = v;
    __syncthreads();
    const u64 out = *slot;
    __syncthreads();
    return out;
  }
  return __shfl_sync(group_mask<G>(), v, 0, G);
}

// Items = rows * per_row pieces; a group of G lanes (0: the whole block) copies one at a time.
// SCHED 0: group g takes items g, g + groups, ...; SCHED 1: the first `groups` items one per group,
// then counter claims (claimed one item ahead). TABLE 2, 3: the next item's row is loaded before
// the current item is copied.
template <int G, int U, int LOAD, int STORE, int SCHED, int TABLE, int COPY>
__device__ __forceinline__ void gather(const u64* rows, u64 items, u64 per_row, u64 piece, u64* counter) {
  __shared__ u64 slot;
  const unsigned size = G ? G : blockDim.x;
  const unsigned rank = G ? threadIdx.x % G : threadIdx.x;
  const u64 groups = G ? (static_cast<u64>(gridDim.x) * blockDim.x) / G : gridDim.x;
  u64 i = G ? (static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x) / G : blockIdx.x;
  if (i >= items) return;  // uniform in a group
  Item cur = decode<G, TABLE>(load_row<G, TABLE>(rows, i, per_row, rank), i, per_row, piece);
  u64 claimed = SCHED ? claim(counter, rank) : 0;
  while (true) {
    u64 j = i + groups;
    if (SCHED) {
      j = share<G>(claimed, &slot) + groups;
      if (j < items) claimed = claim(counter, rank);
    }
    const bool more = j < items;
    Raw next{0, 0, 0};
    if ((TABLE == 2 || TABLE == 3) && more) next = load_row<G, TABLE>(rows, j, per_row, rank);
    if (cur.bytes) copy_piece<COPY, U, LOAD, STORE>(cur.dst, cur.src, cur.bytes, rank, size);
    if (!more) break;
    if (TABLE == 0 || TABLE == 1) next = load_row<G, TABLE>(rows, j, per_row, rank);
    cur = decode<G, TABLE>(next, j, per_row, piece);
    i = j;
  }
}

#define VARIANT(NAME, THREADS, G, U, LOAD, STORE, SCHED, TABLE, COPY)                                  \
  extern "C" __global__ void __launch_bounds__(THREADS)                                              \
  NAME(const u64* rows, u64 items, u64 per_row, u64 piece, u64* counter) {                           \
    gather<G, U, LOAD, STORE, SCHED, TABLE, COPY>(rows, items, per_row, piece, counter);             \
  }
"""

LOADS = {"": 0, "nc": 1, "vol": 2, "l2p": 3}
STORES = {"": 0, "cs": 1, "na": 2, "g": 3}
TABLES = {"t0": 0, "t1": 1, "pf": 2, "pf0": 3}
SCHEDS = {"st": 0, "at": 1}


@dataclass(frozen=True)
class Variant:
    name: str
    group: int = 32
    unroll: int = 8
    load: str = ""
    store: str = ""
    table: str = "pf"
    sched: str = "st"
    copy: str = "vec"
    threads: int = 512
    bpsm: int = 0
    piece: int = 32 << 10
    host: bool = False

    def macro(self) -> str:
        sym = f"v_{self.name}"
        return (
            f"VARIANT({sym}, {self.threads}, {self.group}, {self.unroll}, {LOADS[self.load]}, "
            f"{STORES[self.store]}, {SCHEDS[self.sched]}, {TABLES[self.table]}, {int(self.copy == 'gc')})"
        )


def _variants() -> list[Variant]:
    v = [
        Variant("base", table="t0", copy="gc"),  # the backend's kernel today
        Variant("w32u8_t0", table="t0"),
        Variant("w32u8_t1", table="t1"),
        Variant("w32u8_pf"),
        Variant("w32u8_pf0", table="pf0"),
        Variant("w32u4_pf", unroll=4),
        Variant("w32u16_pf", unroll=16),
        Variant("w32u8_pf_nc", load="nc"),
        Variant("w32u8_pf_vol", load="vol"),
        Variant("w32u8_pf_l2p", load="l2p"),
        Variant("w32u8_pf_cs", store="cs"),
        Variant("w32u8_pf_na", store="na"),
        Variant("w32u8_pf_nc_cs", load="nc", store="cs"),
        Variant("w32u8_pf_nc_na", load="nc", store="na"),
        Variant("w32u8_pf_nc_g", load="nc", store="g"),  # the kernel of branch iolink
        Variant("w32u8_pf_nc_g_p8k", load="nc", store="g", piece=8 << 10),
        Variant("w32u8_pf_nc_g_p16k", load="nc", store="g", piece=16 << 10),
        Variant("w32u8_pf_nc_g_p64k", load="nc", store="g", piece=64 << 10),
        Variant("w32u8_pf_nc_g_at", load="nc", store="g", sched="at"),
        Variant("w32u16_pf_nc_g", unroll=16, load="nc", store="g"),
        Variant("h16u16_pf_nc_g", group=16, unroll=16, load="nc", store="g"),
        Variant("h16u16_pf_nc_g_at", group=16, unroll=16, load="nc", store="g", sched="at"),
        Variant("w32u8_pf_nc_g_g4", load="nc", store="g", bpsm=4),
        Variant("w32u8_pf_nc_g_t1024", load="nc", store="g", threads=1024),
        Variant("w32u16_pf_nc", unroll=16, load="nc"),
        Variant("h16u16_pf", group=16, unroll=16),
        Variant("h16u16_pf_nc", group=16, unroll=16, load="nc"),
        Variant("h16u8_pf", group=16, unroll=8),
        Variant("q8u16_pf", group=8, unroll=16),
        Variant("w32u8_pf_at", sched="at"),
        Variant("w32u8_pf_nc_at", load="nc", sched="at"),
        Variant("h16u16_pf_at", group=16, unroll=16, sched="at"),
        Variant("w32u8_pf_t256", threads=256),
        Variant("w32u8_pf_t1024", threads=1024),
        Variant("w32u8_pf_g1", bpsm=1),
        Variant("w32u8_pf_g2", bpsm=2),
        Variant("w32u8_pf_g4", bpsm=4),
        Variant("w32u8_pf_t256g4", threads=256, bpsm=4),
        Variant("w32u8_pf_t1024g1", threads=1024, bpsm=1),
        Variant("w32u8_pf_p4k", piece=4 << 10),
        Variant("w32u8_pf_p16k", piece=16 << 10),
        Variant("w32u8_pf_p64k", piece=64 << 10),
        Variant("w32u8_pf_nc_p16k", load="nc", piece=16 << 10),
        Variant("w32u8_pf_nc_p64k", load="nc", piece=64 << 10),
        Variant("w32u16_pf_nc_p64k", unroll=16, load="nc", piece=64 << 10),
        Variant("blk_t256", group=0, threads=256, table="t0"),
        Variant("blk_t512", group=0, threads=512, table="t0"),
        Variant("blk_t1024", group=0, threads=1024, table="t0"),
        Variant("blk_t512_nc", group=0, threads=512, table="t0", load="nc"),
        Variant("blk_t512_row", group=0, threads=512, table="t0", piece=256 << 10),
        Variant("blk_t1024_row", group=0, threads=1024, table="t0", piece=256 << 10),
        Variant("blk_t512_at", group=0, threads=512, table="t0", sched="at"),
        Variant("blk_t512_nc_u16", group=0, threads=512, table="t0", load="nc", unroll=16),
        # Last: a device fault here (host memory the GPU cannot map) would end every later variant.
        Variant("w32u8_pf_host", host=True),
        Variant("w32u8_pf_nc_host", load="nc", host=True),
    ]
    names = [x.name for x in v]
    assert len(names) == len(set(names)), "variant names must be unique"
    return v


VARIANTS = _variants()


def kernel_source(variants: list[Variant]) -> str:
    """The template and one ``extern "C"`` kernel per distinct instance of it."""
    return KERNEL_TEMPLATE + "\n".join(v.macro() for v in variants) + "\n"


def compile_variants(variants: list[Variant], arch: str) -> bytes:
    return nvrtc.compile(kernel_source(variants), name="gather_sweep.cu", arch=arch, output="cubin")


@dataclass
class Point:
    op: str  # read: GPU 0 pulls from GPU 1; write: GPU 0 pushes into GPU 1
    size: int
    batch: int
    layout: str  # scat: remote blocks reversed, one row each; cont: one row of everything
    tables: dict[bool, torch.Tensor] = field(default_factory=dict)  # host? -> (rows, 3) int64
    dst: torch.Tensor | None = None
    expect: torch.Tensor | None = None

    @property
    def label(self) -> str:  # r4K/s = read, 16384 x 4 KiB, scattered
        return f"{self.op[0]}{self.size >> 10}K/{self.layout[0]}"


def _enable_peer_access(local: int, remote: int) -> None:
    ctx_remote = cu.init_device(remote)
    cu.init_device(local)  # current: the kernels' device
    drv = cu.driver()
    err = drv.cuCtxEnablePeerAccess(ctx_remote, 0)[0]
    if err not in (drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise RuntimeError(f"cuCtxEnablePeerAccess: {err}")


def _make_points(bufs: dict[int, torch.Tensor]) -> list[Point]:
    """The four layouts x two directions; the expected destination bytes on the destination GPU."""
    points = []
    for op in ("read", "write"):
        src_gpu, dst_gpu = (1, 0) if op == "read" else (0, 1)
        src, dst = bufs[src_gpu], bufs[dst_gpu + 10]
        for size, batch in ((4 << 10, 16384), (256 << 10, 1024)):
            for layout in ("scat", "cont"):
                n = size * batch
                p = Point(op, size, batch, layout, dst=dst[:n])
                if layout == "cont":
                    rows = torch.tensor([[src.data_ptr(), dst.data_ptr(), n]], dtype=torch.int64)
                    p.expect = src[:n].to(f"cuda:{dst_gpu}")
                else:
                    k = torch.arange(batch, dtype=torch.int64)
                    local, remote = k * size, (batch - 1 - k) * size
                    s_off, d_off = (remote, local) if op == "read" else (local, remote)
                    rows = torch.stack(
                        [src.data_ptr() + s_off, dst.data_ptr() + d_off, torch.full_like(k, size)], dim=1
                    )
                    blocks = src[:n].view(batch, size)
                    # dst block at d_off gets the src block at s_off
                    order = torch.argsort(d_off)
                    p.expect = blocks[(s_off[order] // size).to(src.device)].reshape(-1).to(f"cuda:{dst_gpu}")
                p.tables[False] = rows.to("cuda:0")
                p.tables[True] = rows.pin_memory()
                points.append(p)
    return points


class Runner:
    def __init__(self, cubin: bytes, stream: torch.cuda.Stream, iters: int) -> None:
        self.drv = cu.driver()
        self.module = cu.call("cuModuleLoadData", cubin)
        dev = cu.call("cuDeviceGet", 0)
        attr = self.drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        self.sms = int(cu.call("cuDeviceGetAttribute", attr, dev))
        self.stream = stream
        self.cu_stream = self.drv.CUstream(stream.cuda_stream)
        self.iters = iters
        self.counter = torch.zeros(2, dtype=torch.int64, device="cuda:0")

    def function(self, v: Variant) -> tuple[object, int]:
        fn = cu.call("cuModuleGetFunction", self.module, f"v_{v.name}".encode())
        fit = int(cu.call("cuOccupancyMaxActiveBlocksPerMultiprocessor", fn, v.threads, 0))
        return fn, fit

    def timed(self, fn) -> float:  # type: ignore[no-untyped-def]
        """Median seconds of fn() on the stream (CUDA events; 2 untimed first)."""
        times = []
        for i in range(self.iters + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            fn()
            end.record(self.stream)
            end.synchronize()
            if i >= 2:
                times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def run(self, v: Variant, fn: object, blocks: int, p: Point) -> str:
        table = p.tables[v.host]
        rows = table.shape[0]
        per_row = -(-p.size * p.batch // v.piece) if p.layout == "cont" else -(-p.size // v.piece)
        piece = v.piece if per_row > 1 else 1 << 62
        args = [
            ctypes.c_uint64(table.data_ptr()),
            ctypes.c_uint64(rows * per_row),
            ctypes.c_uint64(per_row),
            ctypes.c_uint64(piece),
            ctypes.c_uint64(self.counter.data_ptr()),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        launch, memset, cs = self.drv.cuLaunchKernel, self.drv.cuMemsetD32Async, self.cu_stream
        counter = self.counter.data_ptr()
        at = v.sched == "at"

        def go() -> None:
            if at:
                cu.check(memset(counter, 0, 2, cs), "cuMemsetD32Async")
            cu.check(launch(fn, blocks, 1, 1, v.threads, 1, 1, 0, cs, ctypes.addressof(params), 0), "cuLaunchKernel")

        assert p.dst is not None and p.expect is not None
        try:
            cu.init_device(0)  # the module's context, whatever torch made current
            p.dst.zero_()
            torch.cuda.synchronize(p.dst.device)
            torch.cuda.synchronize(0)
            go()  # the first launch alone: a fault shows here, before any timing
            t = self.timed(go)
            self.stream.synchronize()
            if not torch.equal(p.dst, p.expect):
                return "FAIL"
        except Exception as e:  # a variant that breaks reports and the run goes on
            print(f"  {v.name} {p.label}: {type(e).__name__}: {e}", file=sys.stderr)
            return "ERR"
        return f"{p.size * p.batch / t / 1e9:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--budget", type=float, default=75.0, help="seconds: start no variant after this")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--source", action="store_true", help="print the CUDA source and exit (no GPU needed)")
    ap.add_argument("--compile", default="", help="only compile for this arch (e.g. sm_90; no GPU needed)")
    args = ap.parse_args()
    variants = [v for v in VARIANTS if not args.only or v.name in args.only.split(",")]
    if args.source:
        print(kernel_source(variants))
        return 0
    if args.compile:
        t0 = time.perf_counter()
        cubin = compile_variants(variants, args.compile)
        print(f"{len(variants)} variants, {len(cubin)} bytes of cubin in {time.perf_counter() - t0:.1f} s")
        return 0
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    total = 256 << 20
    bufs = {g: torch.randint(0, 256, (total,), dtype=torch.uint8, device=f"cuda:{g}") for g in (0, 1)}
    bufs.update({10 + g: torch.zeros(total, dtype=torch.uint8, device=f"cuda:{g}") for g in (0, 1)})
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    torch.cuda.set_device(0)
    _enable_peer_access(0, 1)
    dev = cu.call("cuDeviceGet", 0)
    attr = cu.driver().CUdevice_attribute
    major = int(cu.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
    minor = int(cu.call("cuDeviceGetAttribute", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
    t0 = time.perf_counter()
    cubin = compile_variants(variants, f"sm_{major}{minor}")
    print(f"compiled {len(variants)} variants for sm_{major}{minor} in {time.perf_counter() - t0:.1f} s")
    stream = torch.cuda.Stream(device=0)
    runner = Runner(cubin, stream, args.iters)
    points = _make_points(bufs)

    # The copy engine: one 256 MiB peer copy each way, and the table upload of the 4K scattered batch.
    drv = cu.driver()
    for name, d, s in (("CE read  (GPU1->GPU0)", bufs[10], bufs[1]), ("CE write (GPU0->GPU1)", bufs[11], bufs[0])):
        t = runner.timed(lambda d=d, s=s: drv.cuMemcpyAsync(d.data_ptr(), s.data_ptr(), total, runner.cu_stream))
        ok = torch.equal(d, s.to(d.device))
        print(f"{name}, one 256 MiB block: {total / t / 1e9:.1f} GB/s {'ok' if ok else 'FAIL'}")
    host_rows = points[0].tables[True]
    dev_rows = torch.empty_like(points[0].tables[False])
    nbytes = host_rows.numel() * 8
    t = runner.timed(lambda: drv.cuMemcpyHtoDAsync(dev_rows.data_ptr(), host_rows.data_ptr(), nbytes, runner.cu_stream))
    print(f"upload of the 16384-row table ({nbytes >> 10} KiB, pinned -> GPU 0): {t * 1e6:.1f} us")

    labels = [p.label for p in points]
    print(
        f"\nkernel on GPU 0, GB/s (median of {args.iters}): r = read (GPU1->GPU0), w = write (GPU0->GPU1); "
        "4K = 16384 x 4 KiB, 256K = 1024 x 256 KiB; /s = scattered (remote blocks reversed, a row each), "
        "/c = contiguous (one row); grid = SMs x blocks per SM (blocks that fit)"
    )
    head = f"{'variant':20} {'thr':>4} {'grid':>9} " + " ".join(f"{lab:>8}" for lab in labels)
    print(head + "\n" + "-" * len(head), flush=True)
    for v in variants:
        if time.perf_counter() - t_start > args.budget:
            print(f"{v.name:20} skipped: past the {args.budget:.0f} s budget")
            continue
        try:
            fn, fit = runner.function(v)
        except Exception as e:
            print(f"{v.name:20} ERR {e}")
            continue
        bpsm = v.bpsm or max(1, fit)
        blocks = runner.sms * bpsm
        cells = [runner.run(v, fn, blocks, p) for p in points]
        print(
            f"{v.name:20} {v.threads:4} {f'{runner.sms}x{bpsm}({fit})':>9} " + " ".join(f"{c:>8}" for c in cells),
            flush=True,
        )
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
