"""How fast the NVLink backend's gather kernel moves a scattered batch, kernel time only (CUDA
events, median), against the copy engine's peer copy of the same bytes in one piece, measured in
the same run: the ceiling of ``batch_read``/``batch_write`` with the host's share taken out.

Sweeps the piece size a warp copies, for 1024 x 256 KiB and 16384 x 4 KiB blocks
(remote blocks in reverse order), reading (GPU 0 -> GPU 1) and writing (GPU 1 -> GPU 0); the
kernel runs on GPU 1 as in the backend. Checks the copied bytes of every configuration.

A benchmark, not a test (pytest does not collect it): it lives with mori-io's tests because it
drives the backend's private kernel (``nvlink._kernels.CopyKernel``), which only mori-io's own tree
may import (``ci/check_layers.py``). ``ci/device/io.sh`` runs it after ``ci/device/io_bench.py``,
whose GPU choice and timing helpers it shares.

Usage: python packages/mori-io/tests/gpu_kernel_sweep.py [--iters 20]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "ci" / "device"))
from io_bench import LOCAL_GPU, TARGET_GPU, event_seconds, peer_copy_gbs  # noqa: E402

from mori.core import cuda as _cuda
from mori.core.gpu import BatchMemcpy
from mori.io.backends.nvlink._kernels import CopyKernel

REMOTE, LOCAL = TARGET_GPU, LOCAL_GPU


def _enable_peer_access(local: int, remote: int) -> None:
    ctx_remote = _cuda.init_device(remote)
    _cuda.init_device(local)  # current: the kernel's device
    drv = _cuda.driver()
    err = drv.cuCtxEnablePeerAccess(ctx_remote, 0)[0]
    if err not in (drv.CUresult.CUDA_SUCCESS, drv.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
        raise RuntimeError(f"cuCtxEnablePeerAccess: {err}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    total = 256 << 20
    remote = torch.randint(0, 256, (total,), dtype=torch.uint8, device=f"cuda:{REMOTE}")
    local = torch.randint(0, 256, (total,), dtype=torch.uint8, device=f"cuda:{LOCAL}")
    torch.cuda.synchronize(REMOTE)
    torch.cuda.synchronize(LOCAL)
    torch.cuda.set_device(LOCAL)
    _enable_peer_access(LOCAL, REMOTE)
    kern = CopyKernel(LOCAL)
    stream = torch.cuda.Stream(device=LOCAL)
    cu_stream = _cuda.driver().CUstream(stream.cuda_stream)
    ce_gbs = peer_copy_gbs(total, args.iters)
    print(
        f"copy engine, one 256 MiB peer copy GPU{REMOTE}->GPU{LOCAL}: {total / ce_gbs / 1e3:.1f} us = {ce_gbs:.1f} GB/s"
    )
    print(f"{'op':5} {'blocks':>12} {'piece':>7} {'grid':>5} {'kernel us':>10} {'GB/s':>7} {'vs CE':>6} {'data':>5}")
    for size, batch in ((256 << 10, 1024), (4 << 10, 16384)):
        offs = np.arange(batch, dtype=np.uint64) * np.uint64(size)
        for op in ("read", "write"):
            src, dst = (remote, local) if op == "read" else (local, remote)
            src_offs, dst_offs = offs[::-1], offs  # the remote side is the scattered one
            if op == "write":
                src_offs, dst_offs = offs, offs[::-1]
            table = kern.tables.take(batch)
            table.rows[:batch, 0] = np.uint64(src.data_ptr()) + src_offs
            table.rows[:batch, 1] = np.uint64(dst.data_ptr()) + dst_offs
            table.rows[:batch, 2] = size
            pieces = [p for p in (8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10) if p <= size] or [size]
            for piece in pieces:
                per_row = -(-size // piece)
                dst[: size * batch].zero_()
                torch.cuda.synchronize(REMOTE)
                torch.cuda.synchronize(LOCAL)
                launch = functools.partial(kern.launch, cu_stream, table, batch, per_row, piece)
                t = event_seconds(launch, stream, args.iters)
                s_blocks = src[: size * batch].view(batch, size)
                d_blocks = dst[: size * batch].view(batch, size)
                ok = bool(torch.equal(d_blocks.to(s_blocks.device), s_blocks.flip(0)))
                gbs = size * batch / t / 1e9
                print(
                    f"{op:5} {f'{batch}x{size >> 10}K':>12} {f'{piece >> 10}K':>7} {kern.grid(batch * per_row):5} "
                    f"{t * 1e6:10.1f} {gbs:7.1f} {100 * gbs / ce_gbs:5.0f}% {'ok' if ok else 'WRONG':>5}",
                    flush=True,
                )
                if not ok:
                    return 1
            if size == 256 << 10:
                hybrid(kern, table, batch, size, src, dst, stream, ce_gbs, op, args.iters)
            kern.tables.give(table)
    return 0


def hybrid(
    kern: CopyKernel,
    table,
    batch: int,
    size: int,
    src: torch.Tensor,
    dst: torch.Tensor,
    stream: torch.cuda.Stream,
    ce_gbs: float,
    op: str,
    iters: int,
) -> None:
    """The first rows by the kernel on ``stream``, the rest by the copy engines
    (cuMemcpyBatchAsync) on a second stream at the same time: whether SMs and copy engines
    together move more over NVLink than either alone."""
    drv = _cuda.driver()
    other = torch.cuda.Stream(device=LOCAL)
    cu_other = drv.CUstream(other.cuda_stream)
    batcher = BatchMemcpy()
    rows = table.rows[:batch].copy()
    for share in (0.0, 0.1, 0.2, 0.3, 0.4, 1.0):
        k = batch - int(round(share * batch))
        ce_rows = rows[k:]

        def both(k: int, ce_rows: np.ndarray) -> None:
            fork = torch.cuda.Event()
            fork.record(stream)
            other.wait_event(fork)
            if k:
                kern.launch(drv.CUstream(stream.cuda_stream), table, k, -(-size // (32 << 10)), 32 << 10)
            queued = len(ce_rows) == 0 or batcher.try_queue(
                ce_rows[:, 1].tolist(), ce_rows[:, 0].tolist(), ce_rows[:, 2].tolist(), cu_other, "hybrid"
            )
            if not queued:
                for s_, d_, n_ in ce_rows.tolist():
                    _cuda.check(drv.cuMemcpyAsync(d_, s_, n_, cu_other), "cuMemcpyAsync")
            join = torch.cuda.Event()
            join.record(other)
            stream.wait_event(join)

        dst[: size * batch].zero_()
        torch.cuda.synchronize(REMOTE)
        torch.cuda.synchronize(LOCAL)
        t = event_seconds(functools.partial(both, k, ce_rows), stream, iters)
        ok = bool(
            torch.equal(
                dst[: size * batch].view(batch, size).to(src.device), src[: size * batch].view(batch, size).flip(0)
            )
        )
        gbs = size * batch / t / 1e9
        print(
            f"{op:5} {f'{batch}x{size >> 10}K':>12} kernel {k:4} rows + copy engines {len(ce_rows):4} rows: "
            f"{t * 1e6:8.1f} us {gbs:7.1f} GB/s {100 * gbs / ce_gbs:5.0f}% {'ok' if ok else 'WRONG'}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
