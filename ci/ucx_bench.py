"""mori-core's UCX engine on its own: latency and bandwidth between two processes, on one host
(UCX's shared-memory transports), on one host on the engine's same-host path (``same-host``:
process_vm_readv/writev after the target's checks), and between two network namespaces joined by
a veth pair (UCX's tcp transport; needs root and iproute2). Prints a table and writes JSON.

    python ci/ucx_bench.py [--lib debian|wheel|PATH] [--where host,same-host,netns] [--iters 200] [--json out.json]
                           [--set MM_ERROR_HANDLING=n] [--points 'write 4 KiB,write 1 MiB'] [--rma] [--lanes 1] [--workers 1]

Each point is timed in the initiator process (submit + wait, one transfer at a time): medians and
minimums of ``--iters`` runs after a warm-up; a batch's blocks land in shuffled order at the target. CPU is the initiator's user + system seconds per GB
moved (both of its threads: the caller and the progress thread).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import statistics
import time
from typing import Any

import numpy as np

from mori.core import testing, ucx
from mori.core.batch import Batch

SIZE = 80 << 20
POINTS = [  # (name, op, block size, blocks)
    ("write 4 KiB", ucx.WRITE, 4096, 1),
    ("read 4 KiB", ucx.READ, 4096, 1),
    ("write 1 MiB", ucx.WRITE, 1 << 20, 1),
    ("read 1 MiB", ucx.READ, 1 << 20, 1),
    ("write 64 x 1 MiB", ucx.WRITE, 1 << 20, 64),
    ("read 64 x 1 MiB", ucx.READ, 1 << 20, 64),
    ("write 64 x 4 KiB", ucx.WRITE, 4096, 64),
    ("read 64 x 4 KiB", ucx.READ, 4096, 64),
    ("write 1024 x 4 KiB", ucx.WRITE, 4096, 1024),
    ("read 1024 x 4 KiB", ucx.READ, 4096, 1024),
]


def _engine(role: str, settings: dict[str, str], options: dict[str, Any]) -> tuple[ucx.UcxEngine, Any]:
    # Private memory with huge pages advised, as numpy allocates large arrays (a shared mapping
    # never gets transparent huge pages; the kernel copies it about half as fast).
    buf = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    arr = np.frombuffer(buf, dtype=np.uint8)
    arr[:] = 1  # touch every page
    eng = ucx.make_engine(role, settings, **options)
    eng.register_memory(1, int(arr.ctypes.data), SIZE)
    return eng, buf


def _target(settings: dict[str, str], options: dict[str, Any]) -> dict[str, Any]:
    eng, buf = _engine("target", settings, options)
    testing.serve_commands({"admit": eng.admit, "close": eng.close}, buf, eng)
    return {"addresses": list(eng.addresses), "library": dict(ucx.ucx_library()), "same_host": eng.same_host_address}


def _initiator(settings: dict[str, str], options: dict[str, Any]) -> None:
    eng, buf = _engine("initiator", settings, options)
    base = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)

    def run(
        addresses: list[bytes], ticket: int, iters: int, points: list[str], same_host: bytes
    ) -> list[dict[str, Any]]:
        peer = eng.connect("target", addresses, ticket, same_host)
        if same_host and not peer.same_host:
            raise RuntimeError(f"the same-host path was refused: {peer.same_host_refusal}")
        lanes = (
            ["same-host path (process_vm_readv/writev)"]
            if peer.same_host
            else [ln.strip() for ln in peer.describe().splitlines() if "lane[" in ln]
        )
        rows = [{"point": "lanes", "lanes": lanes}]
        for name, op, size, batch in POINTS:
            if points and name not in points:
                continue
            # Blocks land in a shuffled order: a batch stays a batch (contiguous blocks would be
            # merged into one by the planner).
            offs = np.arange(batch, dtype=np.uint64) * np.uint64(size)
            roffs = np.random.default_rng(batch).permutation(offs)
            sizes = np.full(batch, size, dtype=np.uint64)
            blocks = Batch(offs, roffs, sizes, src_base=base)
            times = []
            n = max(3, iters if size * batch <= 1 << 20 else iters // 4)
            for i in range(n + n // 5 + 2):
                c0 = os.times()
                t0 = time.perf_counter()
                t = peer.submit(op, 1, blocks, 1)
                t.wait(60)
                dt = time.perf_counter() - t0
                c1 = os.times()
                if t.code() != 0:
                    raise RuntimeError(f"{name}: {t.message()}")
                if i >= n // 5 + 2:  # warm-up done
                    times.append((dt, (c1.user - c0.user) + (c1.system - c0.system)))
            secs = [t for t, _ in times]
            cpu = sum(c for _, c in times)
            nbytes = size * batch
            rows.append(
                {
                    "point": name,
                    "bytes": nbytes,
                    "median_us": statistics.median(secs) * 1e6,
                    "min_us": min(secs) * 1e6,
                    "gb_s": nbytes / statistics.median(secs) / 1e9,
                    "cpu_s_per_gb": cpu / (nbytes * len(times) / 1e9),
                }
            )
        return rows

    testing.serve_commands({"run": run, "close": eng.close}, buf, eng)


def bench(
    lib: str, where: str, iters: int, options: dict[str, Any], extra: dict[str, str], points: list[str]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    env = {"MORI_UCX_LIB": lib, "UCX_LOG_LEVEL": "error"} if lib else {"UCX_LOG_LEVEL": "error"}
    with contextlib.ExitStack() as stack:
        ns: tuple[testing.Namespace, ...] = ()
        settings: dict[str, str] = dict(extra)
        if where == "netns":
            ns = stack.enter_context(testing.network_namespaces())
            settings = {"TLS": "tcp", "NET_DEVICES": ",".join(n.device for n in ns), **extra}
        target = testing.CommandProcess(
            _target, (settings, options), "target", 120.0, env, start=testing.start_in_netns(ns[1].name if ns else None)
        )
        stack.callback(target.close)
        init = testing.CommandProcess(
            _initiator,
            (settings, options),
            "initiator",
            600.0,
            env,
            start=testing.start_in_netns(ns[0].name if ns else None),
        )
        stack.callback(init.close)
        offer = target.ready["same_host"] if where == "same-host" else b""
        rows = init.call("run", target.ready["addresses"], target.call("admit", "initiator"), iters, points, offer)
        return target.ready["library"], rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", default="", help="debian, wheel, or a UCX folder (default: mori's choice)")
    ap.add_argument("--where", default="host,netns")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--event", action="store_true", help="progress threads only sleep (PollCqMode.EVENT)")
    ap.add_argument("--rma", action="store_true", help="the RMA data path (trusted peers: no target-side checks)")
    ap.add_argument("--lanes", type=int, default=1, help="endpoints per worker and peer (MORI's qp_per_transfer)")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="UCX workers, each with its progress thread; a transfer of 512 KiB or more is spread over them",
    )
    ap.add_argument("--set", action="append", default=[], help="a UCX setting NAME=VALUE (repeatable)")
    ap.add_argument("--points", default="", help="comma-separated point names (default: all)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.set)
    options = {"polling": not args.event, "rma": args.rma, "lanes": args.lanes, "workers": args.workers}
    points = [p for p in args.points.split(",") if p]
    lib = {"debian": "/usr/lib/x86_64-linux-gnu", "wheel": ""}.get(args.lib, args.lib)
    if args.lib == "wheel":
        import importlib.util

        spec = importlib.util.find_spec("libucx")
        assert spec and spec.submodule_search_locations, "the libucx wheel is not installed"
        lib = os.path.join(next(iter(spec.submodule_search_locations)), "lib")
    out = []
    for where in args.where.split(","):
        library, rows = bench(lib, where, args.iters, options, extra, points)
        print(
            f"\n{where}: UCX {'.'.join(map(str, library['version']))} ({library['path']}), "
            f"{'event' if args.event else 'polling'} progress, {'RMA' if args.rma else 'checked'} path, "
            f"{args.workers} worker(s), {args.lanes} lane(s), "
            f"settings {extra or 'default'}"
        )
        print("\n".join(rows[0]["lanes"]))
        print(f"{'point':<22}{'median us':>12}{'min us':>10}{'GB/s':>9}{'CPU s/GB':>10}")
        for r in rows[1:]:
            print(
                f"{r['point']:<22}{r['median_us']:>12.1f}{r['min_us']:>10.1f}{r['gb_s']:>9.2f}{r['cpu_s_per_gb']:>10.2f}"
            )
        out.append({"where": where, "library": library, "options": options, "settings": extra, "rows": rows})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
