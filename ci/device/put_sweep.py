"""Sweep of NVLink put variants on 2 GPUs (run under torchrun --nproc_per_node=2), GPU 0 -> GPU 1.

* (a) put bandwidth at 16, 64 and 256 MiB: the put kernel of put_sweep_kernels.cu with its unroll,
  bytes per thread per step, threads per block, load / store cache flavours, launch bounds and
  layout (one contiguous slice per block, or chunks dealt round-robin) varied, each at 66, 132,
  264 and 396 blocks (528 too at 256 threads); against bench_shmem.py's put_bw (the mori API,
  whatever copy.cuh is installed) and the copy engine, in the same run;
* (b) one-way latency of an 8-byte put with signal: publish and wait flavours (see the kernel
  source), against the API and the bench's raw floor (bench_shmem.py's ping_pong).

Every variant's bytes are checked (bandwidth: the whole destination against the source, and a
guard past its end; latency: every payload received); a failing variant prints FAIL and the run
goes on. Prints one table on rank 0 and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from bench_shmem import KERNELS, Bench, Prepared, init_two_pes, timed

import mori.shmem as shmem
from mori.core import cuda as cu

SOURCE = KERNELS + (Path(__file__).with_name("put_sweep_kernels.cu")).read_text()

SIZES = [16 << 20, 64 << 20, 256 << 20]
BLOCKS = [66, 132, 264, 396]
GUARD = 4096  # bytes past the end of each put that must stay zero
MIB = 1 << 20

# (row label, kernel, threads per block, chunk bytes (0: one contiguous slice per block), block counts)
BW_VARIANTS: list[tuple[str, str, int, int, list[int]]] = [
    ("base u8 16B t512 (= copy.cuh)", "bw_base", 512, 0, BLOCKS),
    ("unroll 4", "bw_u4", 512, 0, BLOCKS),
    ("unroll 16", "bw_u16", 512, 0, BLOCKS),
    ("32B/thread u4", "bw_v32u4", 512, 0, BLOCKS),
    ("32B/thread u8", "bw_v32u8", 512, 0, BLOCKS),
    ("ld.nc.L1::no_allocate", "bw_ldnc", 512, 0, BLOCKS),
    ("ld.L1::no_allocate", "bw_ldna", 512, 0, BLOCKS),
    ("st.cs", "bw_stcs", 512, 0, BLOCKS),
    ("st.L1::no_allocate", "bw_stna", 512, 0, BLOCKS),
    ("ld.nc + st.cs", "bw_ldnc_stcs", 512, 0, BLOCKS),
    ("unroll 16 + st.cs", "bw_u16_stcs", 512, 0, BLOCKS),
    ("2 blocks/SM bound (<=64 regs)", "bw_occ2", 512, 0, BLOCKS),
    ("t256", "bw_t256", 256, 0, BLOCKS + [528]),
    ("t256 unroll 16", "bw_t256u16", 256, 0, BLOCKS + [528]),
    ("t1024", "bw_t1024", 1024, 0, BLOCKS),
    ("t1024 unroll 4", "bw_t1024u4", 1024, 0, BLOCKS),
    ("chunks 64K round-robin", "bw_base", 512, 64 << 10, BLOCKS),
    ("chunks 16K round-robin", "bw_base", 512, 16 << 10, BLOCKS),
    ("chunks 256K round-robin", "bw_base", 512, 256 << 10, BLOCKS),
    ("unroll 16, chunks 64K", "bw_u16", 512, 64 << 10, BLOCKS),
    ("unrolled tail (= branch copy.cuh)", "bw_tail", 512, 0, BLOCKS + [528]),
    ("unrolled tail, unroll 16", "bw_u16_tail", 512, 0, BLOCKS + [528]),
    ("unrolled tail, t1024", "bw_t1024_tail", 1024, 0, BLOCKS),
    ("unrolled tail, t256", "bw_t256_tail", 256, 0, BLOCKS + [528]),
    ("unrolled tail, st.cs", "bw_stcs_tail", 512, 0, BLOCKS + [528]),
    ("unrolled tail, 2 blocks/SM bound", "bw_tail_occ2", 512, 0, BLOCKS + [528]),
    ("unrolled tail, quiet: 1 fence/block", "bw_tail_quiet1", 512, 0, BLOCKS + [528]),
    ("unrolled tail, no quiet (timing only)", "bw_tail_noquiet", 512, 0, BLOCKS + [528]),
    ("unrolled tail, chunks 64K", "bw_tail", 512, 64 << 10, BLOCKS),
]

# (row label, kernel); the bench's own ping_pong rows are added as "bench api" and "bench raw floor".
# The API wait (ShmemWaitUntil) traps on timeout, which ends the run: its rows come last.
LAT_VARIANTS = [
    ("st.release sig / ld.acquire poll", "lat_rel_acq"),
    ("st.release / ld.acquire + nanosleep 32", "lat_rel_acq_sleep"),
    ("st.release / ld.relaxed poll + fence", "lat_rel_rlx"),
    ("st.release / ld.volatile poll + fence", "lat_rel_vol"),
    ("fence.sc + st.relaxed / ld.acquire", "lat_fsc_acq"),
    ("fence.sc + st.relaxed / ld.relaxed+fence", "lat_fsc_rlx"),
    ("fence.acq_rel + st.relaxed / ld.acquire", "lat_far_acq"),
    ("fence.acq_rel + st.relaxed / ld.rlx+fence", "lat_far_rlx"),
    ("red.release.add / ld.acquire", "lat_red_acq"),
    ("red.release.add / ld.relaxed + fence", "lat_red_rlx"),
    ("LL8 flag-in-word (ref, not put+signal)", "lat_ll8"),
    ("LL8 + nanosleep 32", "lat_ll8_sleep"),
    ("API put+signal, relaxed poll + fence", "lat_api_put_rlx_wait"),
    ("API put+signal, API wait (checked)", "lat_api"),
]


def reps_for(size: int) -> int:
    """Launches per timed trial: about 4 ms of puts at ~370 GB/s."""
    return max(3, min(200, int(4e-3 * 370e9 / size)))


class Sweep:
    def __init__(self, trials: int) -> None:
        self.trials = trials
        self.me = shmem.shmem_mype()
        t = time.time()
        self.module = shmem.shmem_load_module(SOURCE, "put_sweep.cu")
        self.compile_s = time.time() - t
        self.stream = torch.cuda.current_stream().cuda_stream
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.fns: dict[str, Any] = {}

    def fn(self, name: str) -> Any:
        if name not in self.fns:
            self.fns[name] = cu.call("cuModuleGetFunction", self.module, name.encode())
        return self.fns[name]

    def launch(self, name: str, grid: int, block: int, args: list[Any]) -> None:
        Prepared(self.fn(name), grid, block, args, self.stream)

    # -- (a) bandwidth ------------------------------------------------------------------------
    def bandwidth(self) -> list[dict[str, Any]]:
        total = max(SIZES) + GUARD
        dest = shmem.shmem_tensor(total, torch.uint8)
        src = torch.randint(1, 256, (total,), dtype=torch.uint8, device=self.dev)  # no zero byte: a skipped byte shows
        peer = shmem.shmem_ptr_p2p(dest.data_ptr(), self.me, 1)
        bad = torch.zeros(1, dtype=torch.int64, device=self.dev)
        rows: list[dict[str, Any]] = []
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        if self.me == 0:
            if peer == 0 or peer % 256 or src.data_ptr() % 256:
                raise SystemExit(f"peer destination {peer:#x} / source {src.data_ptr():#x} not mapped or not aligned")
            variants = [("mori API put_bw (installed copy.cuh)", "put_bw", 512, 0, BLOCKS + [528])] + BW_VARIANTS
            for label, kernel, threads, chunk, blocks in variants:
                for size in SIZES:
                    rows.append(self._bw_row(label, kernel, threads, chunk, blocks, size, src, dest, peer, bad))
            for size in SIZES:
                rows.append(self._ce_row(size, src, peer, bad))
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        return rows

    def _check(self, src: torch.Tensor, peer: int, size: int, bad: torch.Tensor) -> int:
        bad.zero_()
        self.launch(
            "sweep_count_diff",
            264,
            512,
            [
                ctypes.c_uint64(src.data_ptr()),
                ctypes.c_uint64(peer),
                ctypes.c_uint64(size),
                ctypes.c_uint64(GUARD),
                ctypes.c_uint64(bad.data_ptr()),
            ],
        )
        return int(bad.item())

    def _zero(self, peer: int, size: int) -> None:
        self.launch("sweep_zero", 264, 512, [ctypes.c_uint64(peer), ctypes.c_uint64(size + GUARD)])

    def _bw_row(
        self,
        label: str,
        kernel: str,
        threads: int,
        chunk: int,
        blocks: list[int],
        size: int,
        src: torch.Tensor,
        dest: torch.Tensor,
        peer: int,
        bad: torch.Tensor,
    ) -> dict[str, Any]:
        row: dict[str, Any] = {"variant": label, "kernel": kernel, "threads": threads, "chunk": chunk, "bytes": size}
        per_blocks: dict[int, float] = {}
        try:
            for b in blocks:
                self._zero(peer, size)
                if kernel == "put_bw":  # the API kernel: symmetric dest, translated inside
                    args = [
                        ctypes.c_uint64(dest.data_ptr()),
                        ctypes.c_uint64(src.data_ptr()),
                        ctypes.c_uint64(size),
                        ctypes.c_int(1),
                    ]
                else:
                    args = [
                        ctypes.c_uint64(peer),
                        ctypes.c_uint64(src.data_ptr()),
                        ctypes.c_uint64(size),
                        ctypes.c_uint64(chunk),
                    ]
                t = timed(Prepared(self.fn(kernel), b, threads, args, self.stream), reps_for(size), self.trials)
                wrong = self._check(src, peer, size, bad)
                if wrong:
                    raise RuntimeError(f"{wrong} wrong 4-byte words at {b} blocks")
                per_blocks[b] = size / t / 1e9
        except Exception as exc:  # a failing variant is reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            with contextlib.suppress(Exception):  # a trapped kernel leaves the context unusable: later rows say so
                torch.cuda.synchronize()
        row["GBps_by_blocks"] = per_blocks
        if per_blocks and "error" not in row:
            best = max(per_blocks, key=lambda k: per_blocks[k])
            row["GBps"], row["blocks"] = per_blocks[best], best
        return row

    def _ce_row(self, size: int, src: torch.Tensor, peer: int, bad: torch.Tensor) -> dict[str, Any]:
        row: dict[str, Any] = {"variant": "copy engine (cuMemcpyAsync)", "kernel": "-", "bytes": size}
        try:
            self._zero(peer, size)
            drv = cu.driver()
            ce = functools.partial(drv.cuMemcpyAsync, peer, src.data_ptr(), size, drv.CUstream(self.stream))
            cu.check(ce(), "cuMemcpyAsync")
            t = timed(ce, reps_for(size), self.trials)
            wrong = self._check(src, peer, size, bad)
            if wrong:
                raise RuntimeError(f"{wrong} wrong 4-byte words")
            row["GBps"], row["blocks"] = size / t / 1e9, "-"
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        return row

    # -- (b) latency --------------------------------------------------------------------------
    def latency(self, iters: int) -> list[dict[str, Any]]:
        sig = shmem.shmem_tensor(2, torch.int64)
        buf = shmem.shmem_tensor(2, torch.int64)  # 16 aligned bytes: LL8 uses both words
        src_word = torch.zeros(2, dtype=torch.int64, device=self.dev)
        elapsed = torch.zeros(1, dtype=torch.int64, device=self.dev)
        bad = torch.zeros(2, dtype=torch.int64, device=self.dev)
        peer = 1 - self.me
        peer_sig = shmem.shmem_ptr_p2p(sig.data_ptr(), self.me, peer)
        peer_buf = shmem.shmem_ptr_p2p(buf.data_ptr(), self.me, peer)
        if buf.data_ptr() % 16 or peer_buf % 16 or sig.data_ptr() % 8:
            raise SystemExit(f"latency buffers not aligned: buf {buf.data_ptr():#x} peer {peer_buf:#x}")
        rows = []
        for label, kernel in LAT_VARIANTS:
            row: dict[str, Any] = {"variant": label, "kernel": kernel}
            lat, errors = [], []
            for _ in range(self.trials):
                sig.zero_()
                buf.zero_()
                bad.zero_()
                torch.cuda.synchronize()
                shmem.shmem_barrier_all()
                try:
                    self.launch(
                        kernel,
                        1,
                        1,
                        [
                            ctypes.c_uint64(sig.data_ptr()),
                            ctypes.c_uint64(buf.data_ptr()),
                            ctypes.c_uint64(src_word.data_ptr()),
                            ctypes.c_int(iters),
                            ctypes.c_int(peer),
                            ctypes.c_int(int(self.me == 0)),
                            ctypes.c_uint64(elapsed.data_ptr()),
                            ctypes.c_uint64(bad.data_ptr()),
                            ctypes.c_uint64(peer_sig),
                            ctypes.c_uint64(peer_buf),
                        ],
                    )
                    torch.cuda.synchronize()
                    wrong, timed_out = (int(x) for x in bad.tolist())
                    if timed_out:
                        errors.append("wait timed out (2 s)")
                    elif wrong:
                        errors.append(f"{wrong} wrong payloads")
                    else:
                        lat.append(elapsed.item() / (2 * iters) / 1e3)
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                failed: list[Any] = [None, None]
                dist.all_gather_object(failed, bool(errors))
                if any(failed):  # one failed trial settles it: do not wait out the others
                    break
            # Both PEs must agree that the variant passed (each checked what it received).
            verdicts: list[Any] = [None, None]
            dist.all_gather_object(verdicts, errors)
            errors = [e for v in verdicts for e in v]
            if errors:
                row["error"] = errors[0]
            else:
                row["us"], row["trials_us"] = statistics.median(lat), lat
            rows.append(row)
        shmem.shmem_barrier_all()
        # The bench's own rows (unchecked payload; timing reference), with its kernel in this module.
        bench = Bench.__new__(Bench)
        bench.me, bench.module, bench.stream, bench.dev = self.me, self.module, self.stream, self.dev
        bench.pp_fn = self.fn("ping_pong")
        for label, raw in (("bench_shmem ping_pong: API", False), ("bench_shmem ping_pong: raw floor", True)):
            try:
                lat = bench.ping_pong(iters, self.trials, raw=raw)
            except Exception as exc:  # its waits trap on timeout: report, keep the rows above
                rows.append({"variant": label, "kernel": "ping_pong", "error": f"{type(exc).__name__}: {exc}"})
                break
            rows.append({"variant": label, "kernel": "ping_pong", "us": statistics.median(lat), "trials_us": lat})
        return rows


def print_bandwidth(bw: list[dict[str, Any]], trials: int, compile_s: float) -> None:
    print(
        f"\nput sweep, GPU 0 -> GPU 1 ({torch.cuda.get_device_name()}), median of {trials}; compile {compile_s:.1f} s"
    )
    print(f"{'variant':<38} {'thr':>4}" + "".join(f" {f'{s // MIB} MiB':>15}" for s in SIZES) + "  GB/s@blocks")
    order: list[str] = []
    cells: dict[str, dict[int, dict[str, Any]]] = {}
    for r in bw:
        key = r["variant"]
        if key not in cells:
            order.append(key)
            cells[key] = {}
        cells[key][r["bytes"]] = r
    for key in order:
        first = next(iter(cells[key].values()))
        line = f"{key:<38} {first.get('threads', '-')!s:>4}"
        errs = []
        for s in SIZES:
            r = cells[key].get(s)
            if r is None:
                line += f" {'-':>15}"
            elif "error" in r:
                line += f" {'FAIL':>15}"
                errs.append(r["error"])
            else:
                line += f" {r['GBps']:>9.1f} @{r['blocks']!s:<4}"
        print(line + (f"  FAIL: {errs[0]}" if errs else ""))


def print_latency(lat: list[dict[str, Any]]) -> None:
    print("\n8-byte put+signal, one-way latency (median of trials)")
    for r in lat:
        print(f"  {r['variant']:<44} " + (f"FAIL: {r['error']}" if "error" in r else f"{r['us']:.3f} us"))


def save(path: str, bw: list[dict[str, Any]], lat: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "bandwidth": bw, "latency": lat}, f, indent=1)
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "put_sweep.json"))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--skip-bw", action="store_true")
    parser.add_argument("--skip-lat", action="store_true")
    args = parser.parse_args()
    init_two_pes()
    start = time.time()
    sweep = Sweep(args.trials)
    bw = [] if args.skip_bw else sweep.bandwidth()
    if sweep.me == 0 and bw:  # printed and saved at once: the latency part may not come back
        print_bandwidth(bw, args.trials, sweep.compile_s)
        save(args.out, bw, [])
    lat = [] if args.skip_lat else sweep.latency(args.iters)  # last: an API wait that traps ends the run
    if sweep.me == 0:
        print_latency(lat)
        print(f"total {time.time() - start:.1f} s")
        save(args.out, bw, lat)
    shmem.shmem_finalize()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
