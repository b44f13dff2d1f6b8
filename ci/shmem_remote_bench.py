"""mori.shmem between two "hosts": remote put bandwidth and put-with-signal latency between two
PEs in two network namespaces joined by a veth pair (UCX on tcp), beside mori-core's UCX engine
moving the same sizes between the same namespaces in the same run (the transport the remote PEs
go through), and with ``--io`` mori-io's RDMA backend and NIXL (mori-io-bench) too. Needs root
and ``ip`` (iproute2, or ``ci/device/netns_ip.py`` on a machine without it). Prints a table and
writes JSON.

    python ci/shmem_remote_bench.py [--sizes 4K,64K,1M,16M,64M] [--iters 20] [--rounds 3] [--json out.json]
                                    [--io] [--peer-python PYTHON_WITH_NIXL] [--io-mem cpu,gpu] [--device]

put: PE 0 (namespace A) puts from its own heap into PE 1's (namespace B) with shmem_putmem, one
call at a time (each is complete when it returns); engine: the same bytes as one UCX engine write
between two processes in the same namespaces (submit + wait), on memory of the heap's kind; the
PEs and the engine pair live for the whole run and take turns every few transfers; mori-io-bench:
its RDMA backend (``MORI_IO_RDMA_TRANSPORTS=tcp``) and, with ``--peer-python``, NIXL 1.5.1's UCX
backend (``UCX_TLS=tcp``), one block a transfer, host memory (private, huge pages advised), at
the start and at the end of every round, moving memory of the heap's kind (``--io-mem``: host
memory, GPU memory (``mori-io-bench --mem-type gpu``) or both; columns of the other kind are
marked), and the ``put/mori-rdma`` (and ``device/mori-rdma``) columns compare the puts with
mori-io's RDMA backend moving memory of the heap's kind. Every process of the
initiating side runs on every other CPU from the first, of the target side on the others (CPU 0
and CPU 1 on a 2-core machine), as on two hosts. Each point is the
median over rounds of the round's median.
put+signal latency: a ping-pong of 8 bytes with a SHMEM_SIGNAL_SET signal, one-way time = round
trip / 2.

``--device`` (a GPU machine; UCX with CUDA support, e.g. ``MORI_UCX_LIB`` at the libucx-cu13
wheel): GPU heaps (``UCX_TLS=tcp,cuda_copy,self``), both PEs on GPU 0 unless there are two;
the put and the ping-pong are also timed from a kernel through the device proxy
(``ci/device/bench_shmem_proxy.py``'s kernels), and the engine moves GPU memory of the heap's
kind (a CUDA VMM allocation), staged through pinned host memory as mori.shmem's engine stages
its heap (``serve_gpu``), with the workers that engine has: "put/engine" is then what mori.shmem
costs over the engine moving the same memory.
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
from pathlib import Path
from typing import Any

from mori.core import config, testing, ucx

CI_DEVICE = Path(__file__).resolve().parent / "device"
UCX_ENV = {"UCX_TLS": "tcp,self"}  # two namespaces of one machine share its shared memory; hosts do not
GPU_UCX_ENV = {"UCX_TLS": os.environ.get("MORI_BENCH_GPU_UCX_TLS", "tcp,cuda_copy,self")}


_STATE: dict[str, Any] = {}  # a worker's objects between calls (each worker is its own process)


def _side_cpus(side: int) -> list[int]:
    """The CPUs of one side (0: the initiator in A, 1: the target in B): every other CPU of this
    process's, so one each on a 2-core machine, half of a GPU machine's each. One CPU per side on
    a large machine starves a GPU PE: its main thread spins in the CUDA synchronize while its
    proxy and progress threads wait for the same CPU (a device put took ~4 ms there)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[side % 2 :: 2] or cpus


def _pin(side: int) -> None:
    """Pins this process's threads made from now on (UCX's included) to its side's CPUs.
    Processes that live for the whole run otherwise keep whatever placement the scheduler first
    gave them, and on a 2-core machine whether sender and receiver share a core doubles or halves
    a pair's bandwidth for the whole run."""
    os.sched_setaffinity(0, set(_side_cpus(side)))


def _pe_init(rank: int, uid: bytes, big: int, device: bool) -> None:
    """Makes this worker PE ``rank`` (collective), with a source and a destination of ``big`` bytes."""
    import mori.shmem as shmem

    _pin(rank)
    if device:
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
    shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, 2, uid)
    if device:
        sys.path.insert(0, str(CI_DEVICE))
        from bench_shmem_proxy import ProxyBench

        _STATE["bench"] = ProxyBench(big)
        return
    import numpy as np

    src, dst, sig = shmem.shmem_malloc(big), shmem.shmem_malloc(big), shmem.shmem_malloc(8)
    _STATE.update(src=src, dst=dst, sig=sig, view=np.ctypeslib.as_array((ctypes.c_ubyte * big).from_address(src)))
    shmem.shmem_barrier_all()


def _pe_puts(rank: int, size: int, iters: int) -> dict[str, list[float]]:
    """Both PEs (a GPU heap's timing is collective): PE 0's seconds per put of ``size`` bytes into
    PE 1's heap, each of ``iters`` after a warm-up (with a GPU heap one mean of ``iters``, also
    from a kernel: ProxyBench.put)."""
    import mori.shmem as shmem

    if "bench" in _STATE:
        _STATE["bench"].put(size, 1)  # warm-up
        host, device = _STATE["bench"].put(size, iters)
        return {"put": [host], "device_put": [device]}
    if rank != 0:
        return {}
    chunk, dst = _STATE["view"][:size], _STATE["dst"]
    shmem.shmem_putmem(dst, chunk, 1)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        shmem.shmem_putmem(dst, chunk, 1)
        times.append(time.perf_counter() - start)
    return {"put": times}


def _pe_ping_pong(rank: int, rounds: int) -> dict[str, float]:
    """Both PEs: one-way seconds of an 8-byte put+signal ping-pong (PE 0 sends round i, waits for answer i)."""
    import mori.shmem as shmem

    if "bench" in _STATE:
        return dict(zip(("signal", "device_signal"), _STATE["bench"].ping_pong(rounds), strict=True))
    sig, dst = _STATE["sig"], _STATE["dst"]
    shmem.shmem_atomic_set(sig, 0, rank)
    shmem.shmem_barrier_all()
    payload = b"x" * 8
    start = time.perf_counter()
    for i in range(1, rounds + 1):
        if rank == 0:
            shmem.shmem_putmem_signal(dst, payload, sig, i, shmem.SHMEM_SIGNAL_SET, 1)
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, i, timeout=60)
        else:
            shmem.shmem_wait_until(sig, shmem.SHMEM_CMP_EQ, i, timeout=60)
            shmem.shmem_putmem_signal(dst, payload, sig, i, shmem.SHMEM_SIGNAL_SET, 0)
    one_way = (time.perf_counter() - start) / rounds / 2
    shmem.shmem_barrier_all()
    return {"signal": one_way}


def _pe_finalize() -> None:
    import mori.shmem as shmem

    if "bench" in _STATE:
        _STATE.pop("bench").close()
    else:
        for name in ("src", "dst", "sig"):
            shmem.shmem_free(_STATE.pop(name))
    shmem.shmem_finalize()


def _uid() -> bytes:
    import mori.shmem as shmem

    return shmem.shmem_get_unique_id()


def _buffer(size: int, gpu: bool, engine: Any) -> tuple[Any, int]:
    """Memory for an engine side: (what keeps it alive, its address). Host memory of the CPU
    heap's kind, a shared mapping of a memfd, so that both sides of the comparison copy the same
    kind of memory (an anonymous shared mapping moved 16 and 64 MiB about 10 % faster in runs
    here; mori-io-bench's and NIXL's buffers are private memory with huge pages advised, another
    kind again); with ``gpu``, GPU memory of the GPU heap's kind (a CUDA VMM allocation on GPU 0),
    which ``engine`` stages through pinned host memory as mori.shmem's does (serve_gpu)."""
    if gpu:
        import torch

        from mori.core import cuda
        from mori.core.memory.cuda_vmm import VmmAllocation
        from mori.core.ucx_atomic import serve_gpu

        context = cuda.init_device(0)
        alloc = VmmAllocation.create(size, 0)
        major, minor = torch.cuda.get_device_capability(0)
        return (alloc, serve_gpu(engine, context, f"sm_{major}{minor}")), alloc.ptr
    fd = os.memfd_create("mori-bench-engine")
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _make_engine(name: str) -> Any:
    """An engine as mori.shmem's remote transport makes it (workers, their order, polling)."""
    workers = config.get("MORI_SHMEM_UCX_WORKERS") or ucx.auto_workers()
    return ucx.make_engine(name, workers=workers, round_robin=False, stand_aside=False)


def _engine_target(size: int, gpu: bool) -> Any:
    _pin(1)
    engine = _make_engine("bench-target")
    buf, addr = _buffer(size, gpu, engine)
    engine.register_memory(1, addr, size, gpu)
    testing.serve_commands({"admit": engine.admit, "close": engine.close}, buf)
    return list(engine.addresses)


def _engine_connect(addresses: list[bytes], ticket: int, big: int, gpu: bool) -> None:
    _pin(0)
    engine = _make_engine("bench-initiator")
    buf, base = _buffer(big, gpu, engine)
    engine.register_memory(1, base, big, gpu)
    _STATE.update(
        engine=engine, buf=buf, base=base, gpu=gpu, peer=engine.connect("target", addresses, ticket, stages_gpu=gpu)
    )


def _engine_writes(size: int, iters: int) -> list[float]:
    """Seconds per engine write of ``size`` bytes, one batch of one row as mori.shmem's transport
    posts it (submit + wait), each of ``iters`` after a warm-up."""
    from mori.core.batch import Batch

    peer, rows, gpu = _STATE["peer"], Batch.one(_STATE["base"], 0, size), _STATE["gpu"]
    times = []
    for i in range(iters + 1):
        start = time.perf_counter()
        done = peer.submit(ucx.WRITE, 1, rows, 1, 0, False, gpu)
        assert done.wait(60) and done.code() == 0, done.message()
        if i:
            times.append(time.perf_counter() - start)
    return times


def _engine_close() -> None:
    _STATE.pop("peer").close()
    _STATE.pop("engine").close()
    _STATE.pop("buf")


class Pairs:
    """Two PEs (namespaces A and B) and an engine pair (target in A, initiator in B), alive for
    the whole run, so that their measurements alternate size by size in the same minutes."""

    def __init__(self, a: Any, b: Any, big: int, device: bool) -> None:
        ucx_env = GPU_UCX_ENV if device else UCX_ENV
        env = {
            **ucx_env,
            "MORI_SHMEM_BACKEND": "gpu" if device else "cpu",
            "MORI_SHMEM_HEAP_SIZE": str(2 * big + (8 << 20)),
            "MORI_BOOTSTRAP_HOST": a.address,
        }
        starts = iter([testing.start_in_netns(a.name), testing.start_in_netns(b.name)])
        self.pes = testing.ProcPool(2, timeout=600, env=env, label="PE", start=lambda p: next(starts)(p))
        # The engine moves bytes the same way, from A into B.
        self.target = testing.CommandProcess(
            _engine_target, (big, device), "engine target", 120, ucx_env, start=testing.start_in_netns(b.name)
        )
        self.initiator = testing.ProcPool(
            1, timeout=600, env=ucx_env, label="engine initiator", start=testing.start_in_netns(a.name)
        )
        uid = self.pes.run_on(0, _uid)
        self.pes.map(_pe_init, [(0, uid, big, device), (1, uid, big, device)])
        self.initiator.run_on(
            0, _engine_connect, self.target.ready, self.target.call("admit", "initiator"), big, device
        )

    def puts(self, size: int, iters: int) -> dict[str, list[float]]:
        return self.pes.map(_pe_puts, [(0, size, iters), (1, size, iters)])[0]  # type: ignore[no-any-return]

    def engine(self, size: int, iters: int) -> list[float]:
        return self.initiator.run_on(0, _engine_writes, size, iters)  # type: ignore[no-any-return]

    def ping_pong(self, rounds: int) -> dict[str, float]:
        return self.pes.map(_pe_ping_pong, [(0, rounds), (1, rounds)])[0]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.initiator.run_on(0, _engine_close)
        self.initiator.close()
        self.target.close()
        self.pes.run(_pe_finalize)
        self.pes.close()


def measure_io(
    a: Any, b: Any, sizes: list[int], iters: int, peer_python: str | None, gpus: bool = False, mem_type: str = "cpu"
) -> list[dict[str, Any]]:
    """mori-io-bench (the RDMA backend, and NIXL when ``peer_python`` has it) between the namespaces,
    moving memory of ``mem_type`` (``cpu`` or ``gpu``: its ``--mem-type``, GPU 0 on a one-GPU machine).
    ``gpus``: the machine has GPUs, where NIXL's UCX backend refuses ``UCX_TLS=tcp`` without
    ``cuda_copy`` (which moves no host memory: the bytes still go over tcp, as mori's), and where
    mori-io's RDMA backend needs ``cuda_copy`` to register GPU memory."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "io.json")
        # Initiators in A on side 0's CPUs, targets in B on side 1's (_pin): the bytes go from A
        # into B, as PE 0's puts do, between the same CPUs.
        initiator, target = (",".join(map(str, _side_cpus(side))) for side in (0, 1))
        cmd = [
            "taskset",
            "-c",
            initiator,
            "ip",
            "netns",
            "exec",
            a.name,
            sys.executable,
            "-m",
            "mori.io.bench",
            "--backend",
            "rdma",
            "--op",
            "write",
            "--sizes",
            ",".join(str(s) for s in sizes),
            "--iters",
            str(iters),
            "--host",
            a.address,
            "--target-host",
            b.address,
            "--target-netns",
            b.name,
            "--max-bytes",
            str(max(sizes)),
            "--json",
            out,
            "--no-progress",
            "--mem-type",
            mem_type,
        ]
        if peer_python:
            cmd += ["--peers", "nixl", "--peer-python", peer_python]
        env = {
            **os.environ,
            "MORI_IO_RDMA_TRANSPORTS": "tcp,cuda_copy" if gpus else "tcp",
            "MORI_BENCH_TARGET_CPUS": target,
        }
        if gpus:
            env["UCX_TLS"] = "tcp,cuda_copy"  # the peers' (mori's RDMA backend names its transports itself)
        subprocess.run(cmd, check=True, env=env, timeout=1800, stdout=subprocess.DEVNULL)
        with open(out) as f:
            rows: list[dict[str, Any]] = json.load(f)["rows"]
    return rows


def _take_io(io_lat: dict[tuple[str, int], list[float]], rows: list[dict[str, Any]], label: str = "") -> None:
    for row in rows:
        io_lat.setdefault((row["engine"] + label, row["size"]), []).append(row["median_lat_us"])


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--io", action="store_true", help="also run mori-io-bench's RDMA backend every round")
    parser.add_argument("--peer-python", default=None, help="with --io: an interpreter with nixl installed")
    parser.add_argument("--device", action="store_true", help="GPU heaps, and device-initiated puts (see above)")
    parser.add_argument(
        "--io-mem",
        default=None,
        help="with --io: the memory mori-io-bench moves, cpu and/or gpu (e.g. gpu,cpu; default: "
        "the heap's kind); columns of the other kind are marked (cpu) or (gpu)",
    )
    args = parser.parse_args()
    heap_mem = "gpu" if args.device else "cpu"
    io_mems = (args.io_mem or heap_mem).split(",")
    if any(m not in ("cpu", "gpu") for m in io_mems):
        parser.error(f"--io-mem {args.io_mem!r}: cpu and/or gpu")
    gpu_machine = args.device or os.path.exists("/dev/nvidiactl")  # where NIXL needs cuda_copy
    sizes = [config.parse_size(s, "--sizes") for s in args.sizes.split(",")]
    names = ["put", "engine"] + (["device_put"] if args.device else [])
    times: dict[str, dict[int, list[float]]] = {n: {s: [] for s in sizes} for n in names}
    signal: dict[str, list[float]] = {}
    io_lat: dict[tuple[str, int], list[float]] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load_before = _load()
    with testing.network_namespaces() as (a, b):

        def io_round() -> None:
            for m in io_mems:
                _take_io(
                    io_lat,
                    measure_io(a, b, sizes, args.iters, args.peer_python, gpu_machine, m),
                    "" if m == heap_mem else f" ({m})",
                )

        pairs = Pairs(a, b, max(sizes), args.device)
        try:
            for r in range(args.rounds):
                if args.io:  # before and after the round's turns: its share of the round's load
                    io_round()
                for s in sizes:
                    # shmem and the engine take turns every few transfers (a GPU heap's in one
                    # turn), which one goes first alternating too: the VM's load, which swings
                    # within seconds, falls on both alike. Each round's point is its median.
                    turn = args.iters if args.device else max(1, args.iters // 6)
                    got: dict[str, list[float]] = {n: [] for n in names}
                    for k in range(0, args.iters, turn):
                        n_k = min(turn, args.iters - k)
                        first = (r + sizes.index(s) + k // turn) % 2 == 0
                        for what in ("shmem", "engine") if first else ("engine", "shmem"):
                            if what == "shmem":
                                for n, ts in pairs.puts(s, n_k).items():
                                    got[n] += ts
                            else:
                                got["engine"] += pairs.engine(s, n_k)
                    for n in names:
                        times[n][s].append(statistics.median(got[n]))
                for n, t in pairs.ping_pong(200).items():
                    signal.setdefault(n, []).append(t)
                if args.io:
                    io_round()
        finally:
            pairs.close()
    others = sorted({e for e, _ in io_lat})
    print(
        f"{started}, load average {load_before} before, {_load()} after; {args.rounds} rounds of {args.iters}, "
        f"medians; {'GPU heaps' if args.device else 'host memory'}; mori-io-bench: "
        + " and ".join({"cpu": "host memory", "gpu": "GPU memory"}[m] for m in io_mems)
    )
    cols = (
        ["shmem put"]
        + (["device put"] if args.device else [])
        + ["engine write", "put/engine"]
        + (["device/engine"] if args.device else [])
        + others
    )
    # The target: within 10 % of mori-io's RDMA backend moving memory of the heap's kind.
    versus_io = "mori-rdma" in others
    shmem_names = ["put"] + (["device_put"] if args.device else [])
    if versus_io:
        cols += [f"{n.replace('_put', '')}/mori-rdma" for n in shmem_names]
    heads = [c + (" GB/s" if "/" not in c else "") for c in cols]
    widths = [max(16, len(h)) for h in heads]
    print(f"{'size':>10} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=True)))
    rows = []
    for s in sizes:
        med = {n: statistics.median(times[n][s]) for n in names}
        gbps = {n: s / med[n] / 1e9 for n in names}
        io = {e: s / statistics.median(io_lat[(e, s)]) / 1e3 if (e, s) in io_lat else None for e in others}
        rows.append(
            {
                "size": s,
                **{f"{n}_gbps": gbps[n] for n in names},
                **{f"{n}_us": med[n] * 1e6 for n in names},
                **{f"{e}_gbps": v for e, v in io.items()},
            }
        )
        cells = (
            [f"{gbps['put']:.3f}"]
            + ([f"{gbps['device_put']:.3f}"] if args.device else [])
            + [f"{gbps['engine']:.3f}", f"{gbps['put'] / gbps['engine']:.0%}"]
            + ([f"{gbps['device_put'] / gbps['engine']:.0%}"] if args.device else [])
            + [f"{v:.3f}" if v is not None else "-" for v in io.values()]
        )
        if versus_io:
            cells += [f"{gbps[n] / io['mori-rdma']:.0%}" if io["mori-rdma"] else "-" for n in shmem_names]
        print(f"{s:>10} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    one_way = {k: statistics.median(v) * 1e6 for k, v in signal.items() if v}
    print(
        "put+signal (8 B) ping-pong, one-way: "
        + ", ".join(f"{k.replace('signal', 'shmem')} {v:.1f} us" for k, v in one_way.items())
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "started": started,
                    "load": [load_before, _load()],
                    "put": rows,
                    "signal_one_way_us": one_way,
                    "io_median_lat_us": {f"{e} {s}": v for (e, s), v in io_lat.items()},
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
