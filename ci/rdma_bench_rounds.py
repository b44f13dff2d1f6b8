"""Issue 21's acceptance benchmark: ``ci/rdma_bench.sh`` (mori RDMA, NIXL, mori TCP between two
network namespaces on UCX's tcp transport) in alternating rounds, write then read, and the median
over rounds of each point's per-round median latency, bandwidth and initiator CPU seconds per GB.
With ``--same-host``: mori-io-bench's RDMA backend beside NIXL on one host instead (CPU memory,
UCX's defaults for both; mori takes its UCX engine's same-host path: its initiator copies a
transfer of up to 64 KiB itself, as NIXL's does, and hands larger ones to the target's thread),
4 KiB and 1 MiB single and 1024 x 4 KiB and 1024 x 1 MiB scattered.

    python ci/rdma_bench_rounds.py PEER_PYTHON [--same-host] [--rounds 3] [--iters 30] [--warmup 5] [--out DIR]
                                   [--num-worker-threads N]

``--warmup``: untimed transfers per point first (mori-io-bench's default, 5). On one host mori's
initiator and target threads hand each large request to each other, and the kernel takes some
hundred transfers to settle where they run (their first 30 on the 2-core VM took 5-7 µs longer
each). A longer warm-up (``--warmup 200``) shows the settled state.

PEER_PYTHON has ``nixl`` installed (``pip install nixl==1.5.1``). Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
POINTS = ["--sizes", "4K,1M", "--batch-sizes", "1,64,1024", "--max-bytes", "64M"]
SAME_HOST_POINTS = ["--sizes", "4K,1M", "--batch-sizes", "1,1024", "--max-bytes", "1G"]


def _command(args: argparse.Namespace, op: str, out: Path) -> tuple[list[str], dict[str, str] | None]:
    """The benchmark run of one round and op, and its environment (None: this one)."""
    workers = ["--num-worker-threads", str(args.num_worker_threads)]
    if not args.same_host:
        return [
            "bash",
            str(HERE / "rdma_bench.sh"),
            args.peer_python,
            "--op",
            op,
            *POINTS,
            "--iters",
            str(args.iters),
            "--warmup",
            str(args.warmup),
            *workers,
            "--json",
            str(out),
        ], None
    env = {**os.environ, "MORI_IO_RDMA_TRANSPORTS": "all"}  # UCX's defaults; no NIC needed here
    return [
        sys.executable,
        "-m",
        "mori.io.bench",
        "--backend",
        "rdma",
        "--peers",
        "nixl",
        "--peer-python",
        args.peer_python,
        "--op",
        op,
        *SAME_HOST_POINTS,
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
        *workers,
        "--no-progress",
        "--json",
        str(out),
    ], env


def _mori_ucx(args: argparse.Namespace) -> str:
    """Which UCX mori's engines load (ucx.load's choice, or MORI_UCX_LIB's), for the table's head."""
    python = sys.executable if args.same_host else os.environ.get("MORI_PYTHON", str(HERE.parent / ".venv/bin/python"))
    code = (
        "from mori.core import ucx; i = ucx.load(); "
        "print('.'.join(map(str, i['version'])), i['path'], '(' + i['source'] + ')')"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or f"unknown ({done.stderr.strip().splitlines()[-1:]})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer_python")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="untimed transfers per point first (see above)")
    p.add_argument("--out", type=Path, default=Path("/tmp/rdma_bench_rounds"))
    p.add_argument("--same-host", action="store_true", help="mori RDMA beside NIXL on one host (see above)")
    p.add_argument(
        "--num-worker-threads",
        type=int,
        default=-1,
        help="mori RDMA's RdmaBackendConfig.num_worker_threads (-1, MORI's default: auto)",
    )
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: dict[tuple[str, str, int, int], list[dict]] = {}
    for r in range(args.rounds):
        for op in ("write", "read"):
            out = args.out / f"{op}{r}.json"
            command, env = _command(args, op, out)
            subprocess.run(command, env=env, check=True, capture_output=True, timeout=1800)
            for row in json.loads(out.read_text())["rows"]:
                rows.setdefault((row["op"], row["engine"], row["size"], row["batch"]), []).append(row)
    print(
        f"medians of {args.rounds} alternating rounds ({args.iters} timed transfers per point and round, "
        f"{args.warmup} untimed first; num_worker_threads {args.num_worker_threads}); mori's UCX: {_mori_ucx(args)}"
    )
    head = f"{'op':5} {'size':>8} {'batch':>5} {'engine':10} {'lat us':>9} {'min us':>8} {'GB/s':>7} {'CPU s/GB':>9}"
    print(head)
    print("-" * len(head))
    for key in sorted(rows, key=lambda k: (k[0], k[3], k[2], k[1])):
        got = rows[key]
        med = {f: statistics.median(x[f] for x in got) for f in ("median_lat_us", "min_lat_us", "median_bw_gbs")}
        cpu = [x["cpu_s_per_gb"] for x in got if "cpu_s_per_gb" in x]
        print(
            f"{key[0]:5} {key[2]:>8} {key[3]:>5} {key[1]:10} {med['median_lat_us']:>9.1f} {med['min_lat_us']:>8.1f} "
            f"{med['median_bw_gbs']:>7.3f} {statistics.median(cpu) if cpu else float('nan'):>9.3f}"
        )


if __name__ == "__main__":
    main()
