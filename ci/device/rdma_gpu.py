"""GPU memory through the RDMA backend (UCX's CUDA transports), two engine processes on one GPU.

``python ci/device/rdma_gpu.py [--host ADDR]``: a target and an initiator process, each with only
the RDMA backend over ``MORI_IO_RDMA_TRANSPORTS`` (default ``tcp,cuda_copy``: there is no RDMA NIC
on the device machine, so UCX stages GPU memory through host memory with cuda_copy). Moves GPU->GPU,
GPU->CPU and CPU->GPU with reads, writes and a scattered batch, checks every byte with torch, and
prints one line per case; exits non-zero if any case fails. Works with any GPU count >= 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

SIZE = 32 << 20


def _pattern(n: int, seed: int, device: str) -> Any:
    import torch

    idx = torch.arange(n, dtype=torch.int64, device=device)
    return ((idx * (131 + seed) + 7 * seed) % 251).to(torch.uint8)


def _engine(key: str, host: str) -> Any:
    import torch  # loads the CUDA runtime before UCX looks for it

    from mori.io import BackendType, IOEngine, IOEngineConfig

    torch.cuda.init()
    engine = IOEngine(key, IOEngineConfig(host=host, port=0))
    engine.create_backend(BackendType.RDMA)
    return engine


def _regions(engine: Any, seed: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    import torch

    gpu = torch.cuda.device_count() - 1
    bufs = {"GPU": _pattern(SIZE, seed, f"cuda:{gpu}"), "CPU": _pattern(SIZE, seed + 1, "cpu")}
    torch.cuda.synchronize()
    descs = {k: engine.register_torch_tensor(v).pack() for k, v in bufs.items()}
    return bufs, descs


def _target(host: str) -> tuple[bytes, dict[str, bytes]]:
    """The target's process: serves ``bytes`` (``n`` bytes of region ``where`` from ``start``, for
    the initiator to compare); returns its engine's and regions' packed descriptors."""
    from mori.core.testing import serve_commands

    engine = _engine("target", host)
    bufs, descs = _regions(engine, 1)
    serve_commands(
        {"bytes": lambda where, start, n: bufs[where][start : start + n].cpu().clone(), "close": engine.close}, bufs
    )
    return engine.get_engine_desc().pack(), descs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args()
    os.environ.setdefault("MORI_IO_RDMA_TRANSPORTS", "tcp,cuda_copy")
    import torch

    from mori.core.testing import CommandProcess
    from mori.io import EngineDesc, MemoryDesc, StatusCode

    target = CommandProcess(_target, (args.host,), name="target", timeout=120)  # 120 s to start and a command
    t_engine, t_descs = target.ready
    failures = 0
    try:
        engine = _engine("initiator", args.host)
        engine.register_remote_engine(EngineDesc.unpack(t_engine))
        remote = {k: MemoryDesc.unpack(v) for k, v in t_descs.items()}
        bufs, _ = _regions(engine, 5)
        local = {k: engine.register_torch_tensor(v) for k, v in bufs.items()}
        print(
            f"transports {os.environ['MORI_IO_RDMA_TRANSPORTS']}, {torch.cuda.get_device_name()}, "
            f"{torch.cuda.device_count()} GPU(s), host {args.host}",
            flush=True,
        )
        block, n = 64 << 10, 64
        offs = [i * block for i in range(n)]
        cases = [
            ("write", "GPU", "GPU"),
            ("read", "GPU", "GPU"),
            ("write", "GPU", "CPU"),
            ("read", "GPU", "CPU"),
            ("write", "CPU", "GPU"),
            ("read", "CPU", "GPU"),
        ]
        for i, (op, lw, rw) in enumerate(cases):
            for kind in ("whole", "batch"):
                if op == "read":  # the destination starts zeroed, the source differs from it
                    bufs[lw].zero_()
                else:  # a pattern this case alone writes
                    bufs[lw].copy_(_pattern(SIZE, 10 + i, str(bufs[lw].device)))
                torch.cuda.synchronize()
                l_offs, r_offs, sizes = (
                    ([0], [0], [SIZE])
                    if kind == "whole"
                    else (offs, [o + (1 << 20) for o in reversed(offs)], [block] * n)
                )
                t0 = time.perf_counter()
                fn = engine.batch_write if op == "write" else engine.batch_read
                st = fn(local[lw], l_offs, remote[rw], r_offs, sizes, engine.allocate_transfer_uid())
                done = st.WaitFor(60_000) != StatusCode.IN_PROGRESS
                dt = time.perf_counter() - t0
                ok = done and st.Succeeded()
                if ok:
                    torch.cuda.synchronize()
                    for lo, ro, sz in zip(l_offs, r_offs, sizes):
                        theirs = target.call("bytes", rw, ro, sz)
                        mine = bufs[lw][lo : lo + sz].cpu()
                        if not torch.equal(mine, theirs):
                            ok = False
                            break
                failures += not ok
                total = sum(sizes)
                print(
                    f"{'PASS' if ok else 'FAIL'} {op:5} local {lw} <-> remote {rw} {kind:5} "
                    f"{total >> 20} MiB in {dt * 1e3:.1f} ms ({total / dt / 1e9:.2f} GB/s) {st}",
                    flush=True,
                )
        engine.close()
    finally:
        target.close()
    print("rdma_gpu:", "all passed" if failures == 0 else f"{failures} case(s) failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
