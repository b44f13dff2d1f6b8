"""mori.shmem between two "hosts": host-initiated remote put bandwidth and put-with-signal latency
between two PEs in two network namespaces joined by a veth pair (UCX on tcp), beside mori-core's
UCX engine moving the same sizes between the same namespaces in the same run (the transport the
remote PEs go through), and optionally mori-io's RDMA backend and NIXL (mori-io-bench). Needs root
and iproute2. Prints a table and writes JSON.

    python ci/shmem_remote_bench.py [--sizes 4K,64K,1M,16M,64M] [--iters 20] [--rounds 3] [--json out.json]
                                    [--io] [--peer-python PYTHON_WITH_NIXL]

put: PE 0 (namespace A) puts from its own heap into PE 1's (namespace B) with shmem_putmem, one
call at a time (each is complete when it returns); engine: the same bytes as one UCX engine write
between two processes in the same namespaces (submit + wait). Rounds alternate which runs first;
each point is the median over rounds of the median over iterations. put+signal latency: a ping-pong
of 8 bytes with a SHMEM_SIGNAL_SET signal, one-way time = round trip / 2.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from mori.core import config, testing, ucx

UCX_ENV = {"UCX_TLS": "tcp,self"}  # two namespaces of one machine share its shared memory; hosts do not


def _pe(rank: int, uid: bytes, sizes: list[int], iters: int) -> dict[str, Any]:
    import numpy as np

    import mori.shmem as shmem

    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, 2, uid)
    big = max(sizes)
    src, dst, sig = shmem.shmem_malloc(big), shmem.shmem_malloc(big), shmem.shmem_malloc(8)
    shmem.shmem_atomic_set(sig, 0, rank)
    shmem.shmem_barrier_all()
    out: dict[str, Any] = {"put": {}}
    view = np.ctypeslib.as_array((ctypes.c_ubyte * big).from_address(src))  # the source, in PE 0's heap
    if rank == 0:
        for size in sizes:
            chunk = view[:size]
            shmem.shmem_putmem(dst, chunk, 1)  # warm-up
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                shmem.shmem_putmem(dst, chunk, 1)
                times.append(time.perf_counter() - start)
            out["put"][size] = statistics.median(times)
    shmem.shmem_barrier_all()
    # Ping-pong: PE 0 sends round i and waits for PE 1's answer i.
    rounds = 200
    payload = b"x" * 8
    start = time.perf_counter()
    for i in range(1, rounds + 1):
        if rank == 0:
            shmem.shmem_putmem_signal(dst, payload, sig, i, shmem.SHMEM_SIGNAL_SET, 1)
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, i, timeout=60)
        else:
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, i, timeout=60)
            shmem.shmem_putmem_signal(dst, payload, sig, i, shmem.SHMEM_SIGNAL_SET, 0)
    out["signal_one_way"] = (time.perf_counter() - start) / rounds / 2
    shmem.shmem_barrier_all()
    for ptr in (src, dst, sig):
        shmem.shmem_free(ptr)
    shmem.shmem_finalize()
    return out


def _uid() -> bytes:
    import mori.shmem as shmem

    return shmem.shmem_get_unique_id()


def _engine_target(size: int) -> Any:
    engine = ucx.make_engine("bench-target")
    buf = mmap.mmap(-1, size)
    engine.register_memory(1, ctypes.addressof(ctypes.c_char.from_buffer(buf)), size)
    testing.serve_commands({"admit": engine.admit, "close": engine.close}, buf)
    return list(engine.addresses)


def _engine_initiator(addresses: list[bytes], ticket: int, sizes: list[int], iters: int) -> dict[int, float]:
    from mori.core.batch import Batch

    engine = ucx.make_engine("bench-initiator")
    big = max(sizes)
    buf = mmap.mmap(-1, big)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    engine.register_memory(1, base, big)
    peer = engine.connect("target", addresses, ticket)
    out = {}
    try:
        for size in sizes:
            rows = Batch.one(base, 0, size)  # as mori.shmem's remote transport posts it: one batch
            times = []
            for i in range(iters + 1):
                start = time.perf_counter()
                done = peer.submit(ucx.WRITE, 1, rows, 1)
                assert done.wait(60) and done.code() == 0, done.message()
                if i:
                    times.append(time.perf_counter() - start)
            out[size] = statistics.median(times)
    finally:
        peer.close()
        engine.close()
    return out


def measure_shmem(a: Any, b: Any, sizes: list[int], iters: int) -> dict[str, Any]:
    env = {**UCX_ENV, "MORI_SHMEM_BACKEND": "cpu", "MORI_SHMEM_HEAP_SIZE": str(2 * max(sizes) + (4 << 20)),
           "MORI_BOOTSTRAP_HOST": a.address}
    starts = iter([testing.start_in_netns(a.name), testing.start_in_netns(b.name)])
    with testing.ProcPool(2, timeout=600, env=env, label="PE", start=lambda p: next(starts)(p)) as pool:
        uid = pool.run_on(0, _uid)
        return pool.map(_pe, [(0, uid, sizes, iters), (1, uid, sizes, iters)])[0]


def measure_engine(a: Any, b: Any, sizes: list[int], iters: int) -> dict[int, float]:
    target = testing.CommandProcess(_engine_target, (max(sizes),), "engine target", 120, UCX_ENV,
                                    start=testing.start_in_netns(a.name))
    try:
        ticket = target.call("admit", "initiator")
        with testing.ProcPool(1, timeout=600, env=UCX_ENV, start=testing.start_in_netns(b.name)) as pool:
            return pool.run_on(0, _engine_initiator, target.ready, ticket, sizes, iters)
    finally:
        target.close()


def measure_io(a: Any, b: Any, sizes: list[int], iters: int, peer_python: str | None) -> list[dict[str, Any]]:
    """mori-io-bench (the RDMA backend, and NIXL when ``peer_python`` has it) between the namespaces."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "io.json")
        cmd = ["ip", "netns", "exec", b.name, sys.executable, "-m", "mori.io.bench", "--backend", "rdma", "--op",
               "write", "--sizes", ",".join(str(s) for s in sizes), "--iters", str(iters), "--host", b.address,
               "--target-host", a.address, "--target-netns", a.name, "--max-bytes", str(max(sizes)), "--json", out,
               "--no-progress"]
        if peer_python:
            cmd += ["--peers", "nixl", "--peer-python", peer_python]
        subprocess.run(cmd, check=True, env={**os.environ, "MORI_IO_RDMA_TRANSPORTS": "tcp"}, timeout=1800)
        with open(out) as f:
            rows: list[dict[str, Any]] = json.load(f)["rows"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--io", action="store_true", help="also run mori-io-bench's RDMA backend")
    parser.add_argument("--peer-python", default=None, help="with --io: an interpreter with nixl installed")
    args = parser.parse_args()
    sizes = [config.parse_size(s, "--sizes") for s in args.sizes.split(",")]
    put: dict[int, list[float]] = {s: [] for s in sizes}
    eng: dict[int, list[float]] = {s: [] for s in sizes}
    signal: list[float] = []
    io_rows: list[dict[str, Any]] = []
    with testing.network_namespaces() as (a, b):
        for r in range(args.rounds):
            order = ["shmem", "engine"] if r % 2 == 0 else ["engine", "shmem"]
            for what in order:
                if what == "shmem":
                    res = measure_shmem(a, b, sizes, args.iters)
                    for s in sizes:
                        put[s].append(res["put"][s])
                    signal.append(res["signal_one_way"])
                else:
                    for s, t in measure_engine(a, b, sizes, args.iters).items():
                        eng[s].append(t)
        if args.io:
            io_rows = measure_io(a, b, sizes, args.iters, args.peer_python)
    rows = []
    # mori-io-bench's engines (mori-rdma, nixl), GB/s from their median latency like ours.
    others = sorted({r["engine"] for r in io_rows})
    io_gbps = {(r["engine"], r["size"]): r["bytes"] / r["median_lat_us"] / 1e3 for r in io_rows}
    print(f"{'size':>10} {'shmem put GB/s':>15} {'engine write GB/s':>18} {'put/engine':>11}"
          + "".join(f" {name + ' GB/s':>16}" for name in others))
    for s in sizes:
        p, e = statistics.median(put[s]), statistics.median(eng[s])
        rows.append({"size": s, "shmem_put_gbps": s / p / 1e9, "engine_write_gbps": s / e / 1e9,
                     "shmem_put_us": p * 1e6, "engine_write_us": e * 1e6,
                     **{f"{name}_gbps": io_gbps.get((name, s)) for name in others}})
        print(f"{s:>10} {s / p / 1e9:>15.3f} {s / e / 1e9:>18.3f} {e / p:>10.0%}"
              + "".join(f" {io_gbps.get((name, s), float('nan')):>16.3f}" for name in others))
    one_way = statistics.median(signal) * 1e6
    print(f"put+signal (8 B) ping-pong, one-way: {one_way:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"put": rows, "signal_one_way_us": one_way, "io": io_rows}, f, indent=1)


if __name__ == "__main__":
    main()
