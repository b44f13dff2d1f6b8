"""TCP backend with GPU memory (staged through pinned host buffers): time per transfer and
bandwidth, GPU<->GPU, GPU<->CPU and CPU<->GPU, read and write, on one GPU or two.

The target engine runs in a spawned process on GPU 0, the initiator here (GPU 1 when there is
one); both have only the TCP backend. Each point is the median of ``--iters`` transfers (after
``--warmup`` untimed ones), each timed from the call to the return of ``status.Wait()``; the bytes
of the last transfer of each point are checked against the target's. Run it twice in one lease (``PYTHONPATH`` set to
another version's mori-io sources for the other run) to compare versions.

``--points 1M:1,4M:1`` measures other points (block:blocks); ``--pairs GPU-CPU,CPU-CPU`` other
local-remote memory pairs (host memory at both ends is the reference: what staging adds); with
``--backend rdma`` both engines have the RDMA backend instead, between engines of one host over
UCX (``MORI_IO_RDMA_TRANSPORTS``, ``MORI_IO_RDMA_SAME_HOST=0``) rather than TCP.

Usage: python ci/device/io_tcp_gpu_bench.py [--iters 10] [--out tcp_gpu.json] [--points ...] [--pairs ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from mori.core.testing import CommandProcess, serve_commands
from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, RdmaBackendConfig, TcpBackendConfig

TARGET_GPU = 0
LOCAL_GPU = 1 if torch.cuda.device_count() >= 2 else 0
REGION = 64 << 20
POINTS = "4M:16,64K:64,4K:1024,4K:1"  # block:blocks
PAIRS = "GPU-GPU,GPU-CPU,CPU-GPU"  # local-remote


def _points(text: str) -> list[tuple[int, int]]:
    """``4M:16,64K:1`` -> [(4 MiB, 16), (64 KiB, 1)]."""
    units = {"K": 1 << 10, "M": 1 << 20}
    out = []
    for item in text.split(","):
        block, blocks = item.split(":")
        out.append((int(block[:-1]) * units[block[-1]] if block[-1] in units else int(block), int(blocks)))
    return out


def _create_backend(engine: IOEngine, backend: str) -> None:
    if backend == "rdma":
        engine.create_backend(BackendType.RDMA, RdmaBackendConfig())
    else:
        engine.create_backend(BackendType.TCP, TcpBackendConfig())


def _target(backend: str) -> tuple[bytes, dict[str, bytes]]:
    """The target's process: serves ``register`` (an initiator's packed engine descriptor) and
    ``bytes`` (the first ``n`` bytes of region ``where``, for the check); returns its engine's and
    regions' packed descriptors."""
    torch.cuda.set_device(TARGET_GPU)
    engine = IOEngine("tcp-gpu-target", IOEngineConfig(host="127.0.0.1", port=0))
    _create_backend(engine, backend)
    regions = {
        "GPU": torch.randint(0, 256, (REGION,), dtype=torch.uint8, device=f"cuda:{TARGET_GPU}"),
        "CPU": torch.randint(0, 256, (REGION,), dtype=torch.uint8),
    }
    torch.cuda.synchronize()
    descs = {k: engine.register_torch_tensor(t).pack() for k, t in regions.items()}

    def region_bytes(where: str, n: int) -> bytes:
        torch.cuda.synchronize()
        return regions[where][:n].cpu().numpy().tobytes()

    serve_commands(
        {
            "register": lambda packed: engine.register_remote_engine(EngineDesc.unpack(packed)),
            "bytes": region_bytes,
            "close": engine.close,
        },
        regions,
    )
    return engine.get_engine_desc().pack(), descs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--points", type=_points, default=_points(POINTS), help=f"block:blocks,... (default {POINTS})")
    ap.add_argument("--pairs", default=PAIRS, help=f"local-remote memory pairs (default {PAIRS})")
    ap.add_argument("--backend", choices=["tcp", "rdma"], default="tcp")
    args = ap.parse_args()
    if torch.cuda.device_count() < 1:
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    target = CommandProcess(_target, (args.backend,), name="target", timeout=120)  # 120 s to start, 60 s a command
    packed, packed_descs = target.ready
    rows: list[dict[str, Any]] = []
    try:
        remote = {k: MemoryDesc.unpack(v) for k, v in packed_descs.items()}
        torch.cuda.set_device(LOCAL_GPU)
        engine = IOEngine("tcp-gpu-initiator", IOEngineConfig(host="127.0.0.1", port=0))
        _create_backend(engine, args.backend)
        engine.register_remote_engine(EngineDesc.unpack(packed))
        target.call("register", engine.get_engine_desc().pack(), timeout=60)
        local_t = {
            "GPU": torch.zeros(REGION, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}"),
            "CPU": torch.zeros(REGION, dtype=torch.uint8),
        }
        local = {k: engine.register_torch_tensor(t) for k, t in local_t.items()}
        print(
            f"{args.backend.upper()} backend, GPU memory staged: target GPU {TARGET_GPU}, initiator GPU {LOCAL_GPU}; "
            f"median of {args.iters}"
        )
        print(f"{'local':5} {'remote':6} {'op':5} {'block':>6} {'blocks':>6} {'median us':>10} {'GB/s':>7}")
        for lk, rk in (pair.split("-") for pair in args.pairs.split(",")):
            for op in ("read", "write"):
                for size, n in args.points:
                    offs = [i * size for i in range(n)]
                    sizes = [size] * n
                    times = []
                    for i in range(args.warmup + args.iters):
                        t0 = time.perf_counter()
                        st = getattr(engine, f"batch_{op}")(
                            local[lk], offs, remote[rk], offs, sizes, engine.allocate_transfer_uid()
                        )
                        st.Wait()
                        if not st.Succeeded():
                            raise RuntimeError(f"{op} {lk}<-{rk} {n}x{size}: {st.Message()}")
                        if i >= args.warmup:
                            times.append(time.perf_counter() - t0)
                    total = size * n
                    # after a read or a write both sides hold the same bytes
                    if target.call("bytes", rk, total, timeout=60) != local_t[lk][:total].cpu().numpy().tobytes():
                        raise RuntimeError(f"{op} {lk}<-{rk} {n}x{size}: bytes differ")
                    med = statistics.median(times)
                    rows.append(
                        {
                            "local": lk,
                            "remote": rk,
                            "op": op,
                            "size": size,
                            "blocks": n,
                            "median_s": med,
                            "gbs": total / med / 1e9,
                        }
                    )
                    print(
                        f"{lk:5} {rk:6} {op:5} {size >> 10:>5}K {n:>6} {med * 1e6:10.1f} {total / med / 1e9:7.2f}",
                        flush=True,
                    )
        engine.close()
    finally:
        target.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
