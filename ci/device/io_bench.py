"""NVLink backend benchmark on 2 GPUs: mori-io's XGMI/NVLink backend against the copy-engine
peer bandwidth measured in the same run.

The target engine runs in its own process on GPU 0; initiators run here on GPU 1 (on a one-GPU
machine on GPU 0 too: then every number is a same-GPU copy between two processes, which measures
the backend's own costs, such as per-transfer latency, but not NVLink) (one per copy
path: ``auto`` = the backend's choice, ``kernel`` = everything through the gather kernel,
``engines`` = everything through the copy engines). Each point reports MORI's benchmark columns
(MaxBW/AvgBW in GB/s = 1e9 bytes/s, MinLat/AvgLat in us) from ``--iters`` timed transfers, each
timed as a user sees it: from the call to the return of ``status.Wait()``.
Layouts: ``contig`` (blocks back to back on both sides: the backend merges them) and
``scatter`` (remote blocks in reverse order: nothing merges). Writes a table and JSON.

``submit`` is the median time until the call returns (the host's share before the copies start).
Offsets and sizes are passed as numpy int64 arrays (the engine checks them without a Python
loop) except on the rows marked ``list``; ``CE`` is the copy-engine setting (stripe x streams).

With ``--peers nixl,mooncake`` the same run also measures NIXL (UCX with its CUDA transports)
and Mooncake Transfer Engine (``nvlink_intra``) between the same two GPUs, on the acceptance
points in the ``scatter`` layout (``mori.io.bench._peers`` with ``MORI_PEER_GPUS``; their read
data is checked), and prints them beside mori's rows.

Usage: python ci/device/io_bench.py --out io_bench.json [--iters 20] [--quick] [--peers nixl,mooncake]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mori.core.testing import CommandProcess, serve_commands
from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, XgmiBackendConfig
from mori.io.backends.nvlink import backend as nvlink
from mori.io.bench import run_peer

TARGET_GPU = 0
LOCAL_GPU = 1 if torch.cuda.device_count() >= 2 else 0  # one GPU: same-GPU copies, not NVLink
POOL = 512 << 20
PATHS = {"auto": None, "kernel": "1T", "engines": "0"}
# Untimed transfers before each point: the first points of a run used to read 3-5 % low (streams,
# tables and the copy engines' first batches warming up) with 3.
WARMUP = 10


def _target() -> tuple[bytes, bytes]:
    """The target's process (a GPU process of its own): serves ``register`` (an initiator's packed
    engine descriptor); returns its own engine's and its pool's packed descriptors."""
    torch.cuda.set_device(TARGET_GPU)
    engine = IOEngine("bench-target", IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.XGMI, XgmiBackendConfig())
    pool = torch.randint(0, 256, (POOL,), dtype=torch.uint8, device=f"cuda:{TARGET_GPU}")
    mem = engine.register_torch_tensor(pool)
    serve_commands(
        {"register": lambda packed: engine.register_remote_engine(EngineDesc.unpack(packed)), "close": engine.close},
        pool,
    )
    return engine.get_engine_desc().pack(), mem.pack()


def event_seconds(fn: Any, stream: torch.cuda.Stream, iters: int) -> float:
    """Median seconds of ``fn()`` queued on ``stream``, timed by CUDA events (3 untimed first)."""
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def peer_copy_gbs(nbytes: int, iters: int) -> float:
    """Copy-engine peer bandwidth GPU 0 -> GPU 1 (torch copy_, CUDA events, median). torch copies
    between devices on the source's current stream and makes the destination's current stream
    wait for it: events there time the copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{TARGET_GPU}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")
    seconds = event_seconds(lambda: dst.copy_(src, non_blocking=True), torch.cuda.current_stream(LOCAL_GPU), iters)
    return nbytes / seconds / 1e9


def _layout(size: int, batch: int, layout: str, lists: bool) -> tuple[Any, Any, Any]:
    local = np.arange(batch, dtype=np.int64) * size
    remote = local if layout == "contig" else local[::-1].copy()
    sizes = np.full(batch, size, dtype=np.int64)
    if lists:
        return local.tolist(), remote.tolist(), sizes.tolist()
    return local, remote, sizes


def measure(
    engine: IOEngine,
    ldesc: MemoryDesc,
    rdesc: MemoryDesc,
    op: str,
    size: int,
    batch: int,
    layout: str,
    session: bool,
    iters: int,
    lists: bool = False,
) -> dict[str, Any]:
    """Times ``iters`` transfers of ``batch`` blocks of ``size`` bytes (offsets as numpy arrays,
    or as Python lists with ``lists``)."""
    l_offs, r_offs, sizes = _layout(size, batch, layout, lists)
    sess = engine.create_session(ldesc, rdesc) if session else None
    times, submits = [], []
    for i in range(iters + WARMUP):
        t0 = time.perf_counter()
        if sess is not None:
            st = getattr(sess, f"batch_{op}")(l_offs, r_offs, sizes, sess.allocate_transfer_uid())
        else:
            st = getattr(engine, f"batch_{op}")(ldesc, l_offs, rdesc, r_offs, sizes, engine.allocate_transfer_uid())
        ts = time.perf_counter()
        st.Wait()
        t1 = time.perf_counter()
        if not st.Succeeded():
            raise RuntimeError(f"{op} {batch}x{size}: {st.Message()}")
        if i >= WARMUP:
            times.append(t1 - t0)
            submits.append(ts - t0)
    total = size * batch
    return {
        "op": op,
        "size": size,
        "batch": batch,
        "layout": layout,
        "session": session,
        "lists": lists,
        "bytes": total,
        "max_bw_gbs": total / min(times) / 1e9,
        "avg_bw_gbs": total / statistics.fmean(times) / 1e9,
        "min_lat_us": min(times) * 1e6,
        "avg_lat_us": statistics.fmean(times) * 1e6,
        "submit_us": statistics.median(submits) * 1e6,
    }


def _fmt_size(n: int) -> str:
    for unit, shift in (("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


PEER_POINTS = [(256 << 10, 1024), (4 << 10, 16384)]


def measure_peers(args: argparse.Namespace, results: list[dict[str, Any]], peer_copy: float) -> list[dict[str, Any]]:
    """Runs each peer on the acceptance points (scatter layout, read and write, GPU 0 -> 1) and
    prints them beside mori's rows of this run."""
    env = dict(os.environ, MORI_PEER_GPUS=f"{TARGET_GPU},{LOCAL_GPU}")
    if os.environ.get("MORI_PEER_LIBDIR"):  # system libraries the device lacks (ci/device/peer_kit.sh)
        env["LD_LIBRARY_PATH"] = ":".join(filter(None, [env.get("LD_LIBRARY_PATH"), os.environ["MORI_PEER_LIBDIR"]]))
    rows: list[dict[str, Any]] = []
    for name in [p for p in args.peers.split(",") if p]:
        for op in ("read", "write"):
            log = Path(args.out).with_name(f"io_peer_{name}_{op}.log")
            got, note = run_peer(name, args.peer_python, "127.0.0.1", op, args.iters, WARMUP, PEER_POINTS, env, log)
            rows += [{"engine": name, "op": op, **r} for r in got]
            if note:
                print(f"note: {note}")
    print("\nNVLink, scatter layout, same run (GB/s are MaxBW / AvgBW; lat in us; % of the peer copy):")
    print(
        f"{'engine':9} {'op':5} {'size':>6} {'batch':>6} {'MaxBW':>8} {'AvgBW':>8} {'MinLat':>9} {'AvgLat':>9} "
        f"{'vs CE':>6} {'data':>6}"
    )
    mine = [
        {"engine": "mori", **r}
        for r in results
        if r["path"] == "auto"
        and r["layout"] == "scatter"
        and not r["session"]
        and not r["lists"]
        and (r["size"], r["batch"]) in PEER_POINTS
    ]
    for r in sorted(mine + rows, key=lambda r: (r["op"], -r["size"], r["engine"])):
        checked = {True: "ok", False: "WRONG", None: "-"}[r.get("checked")]
        print(
            f"{r['engine']:9} {r['op']:5} {_fmt_size(r['size']):>6} {r['batch']:>6} {r['max_bw_gbs']:8.1f} "
            f"{r['avg_bw_gbs']:8.1f} {r['min_lat_us']:9.1f} {r['avg_lat_us']:9.1f} "
            f"{100 * r['max_bw_gbs'] / peer_copy:5.0f}% {checked:>6}"
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="io_bench.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="only the acceptance points")
    ap.add_argument("--peers", default="", help="also measure these peers: nixl,mooncake")
    ap.add_argument("--peer-python", default=sys.executable, help="interpreter where the peers are installed")
    args = ap.parse_args()
    if torch.cuda.device_count() < 1:
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    target = CommandProcess(_target, name="target", timeout=120)  # 120 s to start, 60 s a command
    packed_engine, packed_mem = target.ready
    engines: dict[str, IOEngine] = {}
    try:
        tdesc, rdesc = EngineDesc.unpack(packed_engine), MemoryDesc.unpack(packed_mem)
        torch.cuda.set_device(LOCAL_GPU)
        local = torch.zeros(POOL, dtype=torch.uint8, device=f"cuda:{LOCAL_GPU}")
        ldescs = {}
        for path, kernel_max in PATHS.items():
            if kernel_max is None:
                os.environ.pop("MORI_IO_NVLINK_KERNEL_MAX", None)
            else:
                os.environ["MORI_IO_NVLINK_KERNEL_MAX"] = kernel_max
            eng = engines[path] = IOEngine(f"bench-{path}", IOEngineConfig(host="127.0.0.1", port=0))
            eng.create_backend(BackendType.XGMI, XgmiBackendConfig())
            eng.register_remote_engine(tdesc)
            target.call("register", eng.get_engine_desc().pack(), timeout=60)
            ldescs[path] = eng.register_torch_tensor(local)
        os.environ.pop("MORI_IO_NVLINK_KERNEL_MAX", None)
        peer = peer_copy_gbs(256 << 20, args.iters)
        print(f"copy-engine peer copy GPU{TARGET_GPU}->GPU{LOCAL_GPU} (torch copy_, 256 MiB, median): {peer:.1f} GB/s")
        # (path, op, size, batch, layout, session, lists, stripe MiB, streams)
        points: list[tuple[str, str, int, int, str, bool, bool, int, int]] = []
        std = (nvlink.STRIPE >> 20, nvlink.ENGINE_STREAMS)
        for op in ("read", "write"):
            points += [
                (path, op, 256 << 10, 1024, layout, False, False, *std)
                for path in ("auto", "engines", "kernel")
                for layout in ("contig", "scatter")
            ]
            points += [
                (path, op, 4 << 10, 16384, "scatter", False, False, *std) for path in ("auto", "engines", "kernel")
            ]
            points += [
                ("auto", op, 4 << 10, 16384, "contig", False, False, *std),
                ("auto", op, 4 << 10, 16384, "scatter", False, True, *std),
                ("auto", op, 4 << 10, 16384, "scatter", True, False, *std),
            ]
        if not args.quick:
            # Copy-engine settings for one large block (1024 x 256 KiB contiguous = one 256 MiB copy).
            points += [
                ("engines", "read", 256 << 10, 1024, "contig", False, False, stripe, streams)
                for stripe, streams in ((256, 1), (128, 2), (64, 4), (32, 8), (8, 8))
            ]
            for op in ("read", "write"):
                points += [
                    (path, op, size, 256, "scatter", False, False, *std)
                    for path in ("kernel", "engines")
                    for size in (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20)
                ]
                points += [
                    ("auto", op, size, 1, "contig", sess, False, *std)
                    for sess in (False, True)
                    for size in (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
                ]
        results = []
        header = (
            f"{'path':8} {'op':5} {'layout':7} {'sess':4} {'input':5} {'CE':>7} {'size':>6} {'batch':>6} "
            f"{'MaxBW':>8} {'AvgBW':>8} {'MinLat':>10} {'AvgLat':>10} {'submit':>7}"
        )
        print(header + "\n" + "-" * len(header))
        for path, op, size, batch, layout, sess, lists, stripe, streams in points:
            nvlink.STRIPE, nvlink.ENGINE_STREAMS = stripe << 20, streams
            r = measure(engines[path], ldescs[path], rdesc, op, size, batch, layout, sess, args.iters, lists)
            r.update(path=path, stripe=stripe << 20, streams=streams, vs_peer_copy=r["max_bw_gbs"] / peer)
            results.append(r)
            print(
                f"{path:8} {op:5} {layout:7} {'yes' if sess else 'no':4} {'list' if lists else 'numpy':5} "
                f"{f'{stripe}Mx{streams}':>7} {_fmt_size(size):>6} {batch:>6} {r['max_bw_gbs']:8.1f} "
                f"{r['avg_bw_gbs']:8.1f} {r['min_lat_us']:10.1f} {r['avg_lat_us']:10.1f} {r['submit_us']:7.1f}",
                flush=True,
            )
        nvlink.STRIPE, nvlink.ENGINE_STREAMS = std[0] << 20, std[1]
        print(
            f"\ncopy engines beside the kernel (share of rows; default {nvlink.ENGINE_SHARE}), "
            "1024 x 256K scattered, MaxBW / AvgBW GB/s:"
        )
        default_share = nvlink.ENGINE_SHARE
        for share in (0.0, 0.2, 0.3, 0.4, 0.5):
            nvlink.ENGINE_SHARE = share
            cells = []
            for op in ("read", "write"):
                r = measure(engines["auto"], ldescs["auto"], rdesc, op, 256 << 10, 1024, "scatter", False, args.iters)
                cells.append(
                    f"{op} {r['max_bw_gbs']:6.1f} / {r['avg_bw_gbs']:6.1f} ({100 * r['max_bw_gbs'] / peer:.0f}%)"
                )
            print(f"  share {share:.1f}: " + "   ".join(cells), flush=True)
        nvlink.ENGINE_SHARE = default_share
        print("\nacceptance (GB/s are MaxBW; the ratio is against the peer copy above):")
        for r in results:
            if (
                r["path"] == "auto"
                and r["op"] == "read"
                and not r["session"]
                and not r["lists"]
                and (r["size"], r["batch"]) in ((256 << 10, 1024), (4 << 10, 16384))
            ):
                goal = "target >= 90% of peer copy" if r["batch"] == 1024 else "target >= 100 GB/s"
                print(
                    f"  read {r['batch']} x {_fmt_size(r['size'])} {r['layout']:7}: {r['max_bw_gbs']:.1f} GB/s "
                    f"({100 * r['vs_peer_copy']:.0f}% of peer copy; {goal})"
                )
        peer_rows = measure_peers(args, results, peer) if args.peers else []
        with open(args.out, "w") as f:
            json.dump({"peer_copy_gbs": peer, "results": results, "peers": peer_rows}, f, indent=1)
        return 0
    finally:
        for eng in engines.values():
            eng.close()
        target.close()


if __name__ == "__main__":
    sys.exit(main())
