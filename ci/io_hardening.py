"""mori-io under a long run and under attack (issue 11's benchmarks; programs, not tests).

``soak``: one initiator writes small blocks to a target engine in another process, each transfer
notifying the target, and nobody ever pops a notification; the target's resident memory is
sampled after a warm-up and along the run. Passes when it stays within +10 % of the warm-up size.

``hostile``: a target engine (default limits, its descriptor limit lowered so that exhaustion is
reachable) is hit on both planes at once with 1,000 idle connections, connections until its
descriptors run out, and slow hellos, control requests and data-plane writes, while an already connected peer keeps
transferring; then everything closes and a fresh peer's first transfer (connect, hello, ticket,
write) is timed. Passes when that takes under 1 s.

    python ci/io_hardening.py soak [--transfers 5000000] [--size 4096] [--json out.json]
    python ci/io_hardening.py hostile [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import struct
import sys
import threading
import time
from typing import Any

import msgpack
import numpy as np

from mori.core.testing import CommandProcess, connect_many, serve_commands
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    StatusCode,
)

REGION = 1 << 20


# ---- the target process ---------------------------------------------------------------------------
def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS (bytes), threads and open descriptors of a process."""
    out = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                out["rss"] = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
    return out


def _target_main(nofile_room: int) -> tuple[bytes, bytes, int]:
    engine = IOEngine("target", IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.TCP)
    arr = np.zeros(REGION, dtype=np.uint8)
    desc = engine.register_memory(int(arr.ctypes.data), REGION, -1, MemoryLocationType.CPU)
    tcp = engine._backends[BackendType.TCP]  # the benchmark reads counters no public API needs
    if nofile_room:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (len(os.listdir("/proc/self/fd")) + nofile_room, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
        )

    def probe() -> dict[str, Any]:
        return {
            "control": dict(vars(engine._server.stats)),
            "data": dict(tcp._target.stats()),
            "records": len(engine._inbound),
        }  # the one table every channel writes

    serve_commands({"probe": probe, "close": engine.close}, arr)
    return engine.get_engine_desc().pack(), desc.pack(), tcp.port


class Target(CommandProcess):
    """The target engine's process; ``probe()`` adds its RSS, threads and descriptors."""

    def __init__(self, nofile_room: int = 0) -> None:
        super().__init__(_target_main, (nofile_room,), "target", timeout=120.0)
        packed, region, self.data_port = self.ready
        self.desc, self.region = EngineDesc.unpack(packed), MemoryDesc.unpack(region)

    def probe(self) -> dict[str, Any]:
        assert self.pid is not None
        out: dict[str, Any] = dict(_proc_status(self.pid))
        out.update(self.call("probe"))
        return out


def _initiator(target: Target, key: str) -> tuple[IOEngine, np.ndarray, MemoryDesc]:
    eng = IOEngine(key, IOEngineConfig())
    eng.create_backend(BackendType.TCP)
    eng.register_remote_engine(target.desc)
    src = np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8)
    return eng, src, eng.register_memory(int(src.ctypes.data), REGION, -1, MemoryLocationType.CPU)


# ---- soak ------------------------------------------------------------------------------------------------
def soak(transfers: int, warmup: int, size: int, window: int) -> dict[str, Any]:
    target = Target()
    eng, src, ld = _initiator(target, "soak")  # src: the registered memory stays alive
    session = eng.create_session(ld, target.region)
    assert session is not None
    slots = REGION // size
    samples: list[tuple[int, int]] = []
    uid = 0

    def run(count: int) -> None:
        nonlocal uid
        inflight = []
        for i in range(count):
            uid += 1
            off = (uid % slots) * size
            inflight.append(session.write(off, off, size, uid))
            if len(inflight) == window or i == count - 1:
                for st in inflight:
                    if st.WaitFor(60_000) != StatusCode.SUCCESS:
                        raise RuntimeError(f"transfer failed: {st!r}")
                inflight.clear()

    try:
        t0 = time.monotonic()
        run(warmup)
        base = target.probe()
        print(
            f"warm-up: {warmup:,} transfers in {time.monotonic() - t0:.0f} s; target RSS "
            f"{base['rss'] / 2**20:.1f} MiB, records kept {base['records']:,}",
            flush=True,
        )
        step = max(transfers // 20, 1)
        t1 = time.monotonic()
        done = 0
        while done < transfers:
            n = min(step, transfers - done)
            run(n)
            done += n
            p = target.probe()
            samples.append((done, p["rss"]))
            print(
                f"{done:>10,} transfers  {done / (time.monotonic() - t1):>8,.0f}/s  RSS {p['rss'] / 2**20:7.1f} MiB "
                f"({p['rss'] / base['rss'] - 1:+.1%})  records {p['records']:,}  "
                f"dropped {p['data']['inbound_dropped']:,}",
                flush=True,
            )
        elapsed = time.monotonic() - t1
        final = target.probe()
    finally:
        eng.close()
        target.close()
    peak = max(r for _, r in samples)
    result = {
        "bench": "soak",
        "transfers": transfers,
        "warmup": warmup,
        "block_bytes": size,
        "window": window,
        "seconds": round(elapsed, 1),
        "per_second": round(transfers / elapsed),
        "rss_after_warmup": base["rss"],
        "rss_peak": peak,
        "rss_final": final["rss"],
        "growth": round(peak / base["rss"] - 1, 4),
        "records_kept": final["records"],
        "records_dropped": final["data"]["inbound_dropped"],
        "samples": samples,
        "passed": peak <= base["rss"] * 1.10,
    }
    print(
        f"soak: {transfers:,} transfers of {size} B with notifications never popped in {elapsed:.0f} s; "
        f"target RSS {base['rss'] / 2**20:.1f} MiB after warm-up, peak {peak / 2**20:.1f} MiB "
        f"({result['growth']:+.1%}): {'PASS' if result['passed'] else 'FAIL'} (limit +10 %)"
    )
    return result


# ---- hostile ----------------------------------------------------------------------------------------------
# ---- the attacker's side of the wire (docs/io.md, "Control plane"), written here as any client would --
def _frame(obj: dict[str, Any]) -> bytes:
    """One control frame: a 4-byte big-endian length, then msgpack."""
    data = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(data)) + data


def _read_frame(sock: socket.socket) -> dict[str, Any]:
    (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(sock.recv(length, socket.MSG_WAITALL), raw=False)


def _ticket(port: int, key: str) -> str:
    """A data-plane ticket for ``key``: hello, then a ``tcp.info`` request, on a control connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(_frame({"op": "hello", "key": key, "token": ""}))
        if not _read_frame(s).get("ok"):
            raise SystemExit(f"the target refused the hello of {key!r}")
        s.sendall(_frame({"op": "tcp.info", "id": 1, "body": {}}))
        reply = _read_frame(s)
    if not reply.get("ok"):
        raise SystemExit(f"tcp.info refused: {reply.get('error')}")
    return reply["body"]["ticket"]


def _open(port: int, n: int, held: list[socket.socket]) -> int:
    socks = connect_many(port, n, timeout=2)
    held.extend(socks)
    return len(socks)


def _trickle(
    port: int,
    payload: bytes,
    stop: threading.Event,
    closed: list[float],
    hello: bytes = b"",
    reply: int = 0,
    header: bytes = b"",
) -> None:
    """Sends ``hello`` at once and reads ``reply`` bytes back, then ``header`` at once, then
    ``payload`` a byte every 0.5 s until the target closes the connection."""
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(hello)
            if reply:
                s.recv(reply, socket.MSG_WAITALL)
            s.sendall(header)
            for b in payload:
                if stop.is_set():
                    return
                s.send(bytes([b]))
                time.sleep(0.5)
    except OSError:
        closed.append(time.monotonic() - t0)


def hostile(idle: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker needs many descriptors
    # Room for fewer descriptors than the two planes' handshake slots (2 x 64): a flood exhausts them.
    target = Target(nofile_room=100)
    steady, steady_src, sld = _initiator(target, "steady")  # steady_src: the registered memory stays alive
    held: list[socket.socket] = []
    stop = threading.Event()
    latencies: list[float] = []
    failures: list[str] = []
    rows: list[tuple[str, dict[str, Any]]] = [("before", target.probe())]

    def steady_peer() -> None:  # connected before the attack: keeps transferring through it
        uid = 0
        while not stop.is_set():
            uid += 1
            t0 = time.monotonic()
            st = steady.write(sld, 0, target.region, 0, 4096, uid)
            if st.WaitFor(30_000) == StatusCode.SUCCESS:
                latencies.append(time.monotonic() - t0)
            else:
                failures.append(st.Message())
            time.sleep(0.01)

    assert steady.write(sld, 0, target.region, 0, 4096, 0).WaitFor(30_000) == StatusCode.SUCCESS
    peer_thread = threading.Thread(target=steady_peer, daemon=True)
    peer_thread.start()
    cut: list[float] = []
    trickles = []
    try:
        # 1,000 idle connections (control plane), then more on both planes until descriptors run out.
        n_idle = _open(target.desc.port, idle, held)
        n_flood = _open(target.data_port, 1500, held) + _open(target.desc.port, 1500, held)
        rows.append(("fd exhaustion", target.probe()))
        # Slow frames: hellos trickled a byte every 0.5 s on both planes, and, after a complete
        # hello, a 1 MiB control request and a 1 MiB data-plane write into the region trickled
        # the same way (cut at MORI_IO_TIMEOUT, 30 s, after this phase: the probe sees them open).
        hello = _frame({"op": "hello", "key": "slow" * 8, "token": ""})
        ticket = _ticket(target.desc.port, "slow")
        data_hello = struct.pack("<IHHHH", 0x4F49524D, 3, 4, 0, len(ticket)) + b"slow" + ticket.encode()
        write_hdr = struct.pack("<IBB2xQQQ", 0x5145524D, 2, 0, target.region.id, 0, REGION)
        slow = [
            (target.desc.port, hello, b"", 0, b""),
            (target.data_port, hello, b"", 0, b""),
            (target.desc.port, b"\x00" * (1 << 20), hello, 0, struct.pack(">I", 1 << 20)),
            (target.data_port, b"\x00" * REGION, data_hello, 8, write_hdr),
        ]
        for port, payload, first, reply, header in slow:
            for _ in range(10):
                th = threading.Thread(
                    target=_trickle, args=(port, payload, stop, cut, first, reply, header), daemon=True
                )
                th.start()
                trickles.append(th)
        time.sleep(12)  # past the hello timeout (10 s)
        rows.append(("slow frames", target.probe()))
    finally:
        for s in held:
            s.close()
        stop.set()
        peer_thread.join(timeout=60)
        for th in trickles:
            th.join(timeout=10)
    time.sleep(0.5)
    t0 = time.monotonic()
    fresh, src, fld = _initiator(target, "fresh")
    st = fresh.write(fld, 0, target.region, 4096, 4096, 1)
    ok = st.WaitFor(30_000) == StatusCode.SUCCESS
    first = time.monotonic() - t0
    rows.append(("after", target.probe()))
    fresh.close()
    steady.close()
    target.close()
    print(
        f"hostile: {n_idle} idle connections, {n_flood} more until descriptors ran out, 20 trickled hellos, "
        f"10 trickled control requests, 10 trickled data-plane writes ({len(cut)} cut by the target, "
        f"after {statistics.median(cut) if cut else float('nan'):.1f} s median)"
    )
    print(
        f"{'phase':<14} {'RSS MiB':>8} {'threads':>8} {'fds':>6} {'ctl refused':>12} {'ctl evicted':>12} "
        f"{'ctl acc.err':>12} {'data refused':>13} {'data evicted':>13} {'data acc.err':>13}"
    )
    for name, p in rows:
        c, d = p["control"], p["data"]
        print(
            f"{name:<14} {p['rss'] / 2**20:>8.1f} {p['threads']:>8} {p['fds']:>6} {c['refused']:>12} "
            f"{c['evicted']:>12} {c['accept_errors']:>12} {d['refused']:>13} {d['evicted']:>13} "
            f"{d['accept_errors']:>13}"
        )
    lat = sorted(latencies)
    print(
        f"steady peer during the attack: {len(lat)} transfers, {len(failures)} failed"
        f"{' (first: ' + failures[0] + ')' if failures else ''}, median "
        f"{statistics.median(lat) * 1e3:.2f} ms, max {lat[-1] * 1e3:.1f} ms"
        if lat
        else "steady peer: none"
    )
    print(
        f"fresh peer after the attack: first transfer (connect + hello + ticket + 4 KiB write) "
        f"{'succeeded' if ok else 'FAILED'} in {first * 1e3:.0f} ms: {'PASS' if ok and first < 1.0 else 'FAIL'} "
        "(limit 1 s)"
    )
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {
        "bench": "hostile",
        "idle": n_idle,
        "flood": n_flood,
        "trickles_cut": len(cut),
        "steady_transfers": len(lat),
        "steady_failures": len(failures),
        "steady_median_ms": statistics.median(lat) * 1e3 if lat else None,
        "fresh_first_transfer_s": round(first, 4),
        "fresh_ok": ok,
        "phases": dict(rows),
        "passed": bool(ok and first < 1.0),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="bench", required=True)
    s = sub.add_parser("soak")
    s.add_argument("--transfers", type=int, default=5_000_000)
    s.add_argument("--warmup", type=int, default=300_000, help="past MORI_IO_MAX_INBOUND_RECORDS (100,000)")
    s.add_argument("--size", type=int, default=4096)
    s.add_argument("--window", type=int, default=32, help="transfers in flight at once")
    h = sub.add_parser("hostile")
    h.add_argument("--idle", type=int, default=1000)
    for p in (s, h):
        p.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    result = soak(args.transfers, args.warmup, args.size, args.window) if args.bench == "soak" else hostile(args.idle)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
