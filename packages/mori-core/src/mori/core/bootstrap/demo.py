"""``python -m mori.core.bootstrap.demo --nprocs 4``: a bootstrap of N local processes, shown step by step.

Starts N real processes. Rank 0 makes the unique id and hands it to the others through a queue;
all of them join, then run allgather, broadcast and alltoall on fresh random bytes and a run of
barriers. Each rank reports a SHA-256 of every block it sent and received; the parent checks
that every block arrived intact where it should, and prints what each step moved and how long
it took (median over the repetitions; a step's time on a rank runs from its call to its return).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
import traceback
from typing import Any

from ..config import parse_size
from ._bootstrap import Bootstrap
from ._uid import UniqueId, get_unique_id

__all__ = ["main"]

_BARRIERS = 100


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _rank(rank: int, world: int, size: int, reps: int, timeout: float, uids: Any, reports: Any) -> None:
    try:
        if rank == 0:
            uid = get_unique_id()
            for _ in range(world - 1):
                uids.put(uid)
        else:
            uid = uids.get(timeout=timeout)
        bs, t_join = _timed(Bootstrap, rank, world, uid, timeout)
        rep: dict[str, Any] = {
            "rank": rank,
            "pid": os.getpid(),
            "join": t_join,
            "uid": uid,
            "allgather": [],
            "broadcast": [],
            "alltoall": [],
        }
        root = world - 1
        chunk = max(1, size // world)
        with bs:
            bs.barrier()  # start the timed steps together
            for _ in range(reps):
                mine = os.urandom(size)
                got, dt = _timed(bs.allgather, mine)
                rep["allgather"].append((dt, _sha(mine), [_sha(g) for g in got]))
                data = os.urandom(size) if rank == root else None
                got_b, dt = _timed(bs.broadcast, data, root)
                rep["broadcast"].append((dt, _sha(got_b)))
                chunks = [os.urandom(chunk) for _ in range(world)]
                got, dt = _timed(bs.alltoall, chunks)
                rep["alltoall"].append((dt, [_sha(c) for c in chunks], [_sha(g) for g in got]))
            times = []
            for _ in range(_BARRIERS):
                _, dt = _timed(bs.barrier)
                times.append(dt)
            rep["barrier"] = times
        reports.put(rep)
    except BaseException:
        reports.put({"rank": rank, "error": traceback.format_exc()})


def _check(reports: list[dict[str, Any]], reps: int) -> list[str]:
    """Every block each rank received, compared with the block its sender made."""
    world = len(reports)
    problems = []
    for k in range(reps):
        own = [r["allgather"][k][1] for r in reports]
        problems += [
            f"allgather rep {k}: rank {r['rank']} holds a wrong block" for r in reports if r["allgather"][k][2] != own
        ]
        sent = reports[world - 1]["broadcast"][k][1]
        problems += [
            f"broadcast rep {k}: rank {r['rank']} got other bytes" for r in reports if r["broadcast"][k][1] != sent
        ]
        for r in reports:
            expected = [reports[i]["alltoall"][k][1][r["rank"]] for i in range(world)]
            if r["alltoall"][k][2] != expected:
                problems.append(f"alltoall rep {k}: rank {r['rank']} got a wrong chunk")
    return problems


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _step_time(reports: list[dict[str, Any]], step: str, reps: int) -> float:
    """Median over repetitions of the slowest rank's time: when the whole collective was done."""
    return statistics.median(max(r[step][k][0] for r in reports) for k in range(reps))


def _summary(reports: list[dict[str, Any]], size: int, reps: int, wall: float) -> str:
    world = len(reports)
    uid = UniqueId.from_bytes(reports[0]["uid"])
    chunk = max(1, size // world)
    rows = []

    def row(step: str, what: str, seconds: float, moved: int) -> None:
        rate = f"{moved / seconds / 1e9:6.2f} GB/s into each rank" if moved and seconds else ""
        rows.append(f"  {step:<11}{what:<46}{seconds * 1e3:9.3f} ms  {rate}")

    join = max(r["join"] for r in reports)
    rows.append(
        f"  {'rendezvous':<11}{f'{world} ranks joined rank 0 at {uid.host}:{uid.port}':<46}{join * 1e3:9.3f} ms"
    )
    row("allgather", f"{_fmt_bytes(size)} from each rank", _step_time(reports, "allgather", reps), size * (world - 1))
    row(
        "broadcast",
        f"{_fmt_bytes(size)} from rank {world - 1}",
        _step_time(reports, "broadcast", reps),
        size if world > 1 else 0,
    )
    row(
        "alltoall",
        f"{_fmt_bytes(chunk)} per pair ({world}x{world})",
        _step_time(reports, "alltoall", reps),
        chunk * (world - 1),
    )
    barrier = statistics.median(max(r["barrier"][k] for r in reports) for k in range(_BARRIERS))
    row("barrier", f"{_BARRIERS} rounds (median shown)", barrier, 0)
    head = (
        f"mori bootstrap demo: {world} processes (pids {', '.join(str(r['pid']) for r in reports)}), "
        f"128-byte unique id, {reps} repetitions of each step on fresh random bytes"
    )
    tail = f"verified: every block of every step arrived byte-identical (SHA-256) at every rank; total {wall:.2f} s"
    return "\n".join([head, *rows, tail])


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m mori.core.bootstrap.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--nprocs", type=int, default=4, help="number of processes (ranks), default 4")
    parser.add_argument("--bytes", default="1M", help="bytes each rank contributes per step, e.g. 64K, 4M (default 1M)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each step (default 5)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds any wait may take (default 30)")
    args = parser.parse_args(argv)
    if args.nprocs < 1 or args.reps < 1 or args.timeout <= 0:
        parser.error("--nprocs and --reps must be >= 1 and --timeout > 0")
    size = parse_size(args.bytes, "--bytes")
    ctx = mp.get_context("spawn")
    uids, reports = ctx.Queue(), ctx.Queue()
    start = time.perf_counter()
    procs = [
        ctx.Process(target=_rank, args=(r, args.nprocs, size, args.reps, args.timeout, uids, reports), daemon=True)
        for r in range(args.nprocs)
    ]
    got: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout + 30
        while len(got) < args.nprocs:
            try:
                got.append(reports.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(args.nprocs)) - {r["rank"] for r in got})
                print(f"demo failed: ranks {missing} did not report in time", file=sys.stderr)
                return 1
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = [r for r in got if "error" in r]
    if failed:
        for r in failed:
            print(f"rank {r['rank']} failed:\n{r['error']}", file=sys.stderr)
        return 1
    got.sort(key=lambda r: r["rank"])
    problems = _check(got, args.reps)
    if problems:
        print("demo failed verification:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(_summary(got, size, args.reps, time.perf_counter() - start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
