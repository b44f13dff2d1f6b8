"""``mori-umbp-bench``: mori.umbp against Mooncake Store, between network namespaces over TCP.

Each system runs as three "hosts" (network namespaces joined by a bridge): its master in the
first, the node that puts and gets in the second, the storage node in the third. The client
node contributes no room, so every page crosses the network: puts into the storage node, gets
from it. The same points run on each system in the same run (:mod:`._measure`): batch put and
get of ``--pages`` pages of each ``--sizes`` size, ``batch_exists`` of ``--exists-keys`` stored
keys, and gets of pages the storage node holds on SSD only (``--points ssd``: those alone).
Mooncake's SSD gets run on a second set of its processes, with its offload on (it writes every
object put to disk, so its other points run without). Medians over ``--iters`` iterations after ``--warmup`` (with ``--rounds``, the systems take turns and
each figure is the median of the rounds' medians); every byte checked once per point,
outside the timed calls. Prints a table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ._hosts import Host, hosts
from ._measure import GROUPS, MARK, capacity_needed

HERE = Path(__file__).resolve().parent
MORI_MASTER_PORT, MC_RPC_PORT, MC_HTTP_PORT, MC_METRICS_PORT = 15558, 50051, 8080, 9003
START_TIMEOUT_S = 120.0
#: mori's systems by ``--mori-grpc`` transport: the default one, and grpcio's for comparison.
_MORI_SYSTEMS = {"auto": "mori", "native": "mori", "python": "mori-grpcio"}


class _Proc:
    """A process of the run, its marked stdout lines read on a thread (other lines kept for
    errors), its stderr in ``log``."""

    def __init__(
        self, name: str, argv: list[str], log: Path, stdin: bool = False, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.log = name, log
        self._log_file = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log_file,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(MARK):
                self._queue.put(("msg", json.loads(line[len(MARK) :])))
            else:
                self.lines = [*self.lines[-50:], line]
                self._queue.put(("line", line))
        self._queue.put(("eof", None))

    def _fail(self, why: str) -> RuntimeError:
        try:
            err = self.log.read_text()[-3000:]
        except OSError:
            err = ""
        return RuntimeError(f"{self.name}: {why}\n--- stdout:\n{''.join(self.lines[-20:])}--- stderr:\n{err}")

    def next(self, timeout: float, want: str = "msg") -> Any:
        """The next marked message (or, ``want="line"``, the next plain line)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise self._fail(f"nothing within {timeout:.0f} s") from None
            if kind == "eof":
                raise self._fail(f"exited ({self.proc.wait(30)})")
            if kind == want:
                return value

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        """Closes stdin (a node's cue to leave), then SIGTERM, then SIGKILL, each bounded."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self._log_file.close()


def _relay(client: _Proc, store: _Proc, timeout: float, label: str) -> list[dict[str, Any]]:
    """Runs the client's points: its rows back, its SSD requests to the storage node."""
    rows = []
    while True:
        msg = client.next(timeout)
        if "row" in msg:
            row = msg["row"]
            rows.append(row)
            print(f"  {label:9} {row['point']:26} {row['median_us']:12.1f} µs", flush=True)
        elif msg.get("ask") == "to_ssd":
            store.send({"keys": msg["keys"]})
            client.send(store.next(timeout))
        elif msg.get("done"):
            return rows


@contextlib.contextmanager
def _processes() -> Iterator[list[_Proc]]:
    procs: list[_Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()


def _mori(
    net: list[Host], plan: dict[str, Any], out: Path, ssd_root: str, timeout: float, grpc: str
) -> list[dict[str, Any]]:
    """mori's points, its processes' gRPC through ``grpc`` (``MORI_UMBP_GRPC``: auto, python, native)."""
    master_host, client_host, store_host = net
    label = _MORI_SYSTEMS[grpc]
    env = {"MORI_UMBP_GRPC": grpc}
    script = Path(sys.executable).with_name("mori-umbp-master")
    ssd_dir = tempfile.mkdtemp(prefix="umbp-bench-ssd-", dir=ssd_root)
    try:
        with _processes() as procs:
            master = _Proc(
                "mori master",
                master_host.command([str(script), f"{master_host.address}:{MORI_MASTER_PORT}", "0"]),
                out / f"{label}-master.log",
                env=env,
            )
            procs.append(master)
            line = master.next(START_TIMEOUT_S, want="line")
            while not line.startswith("[Master] Listening on "):
                line = master.next(START_TIMEOUT_S, want="line")
            common = {**plan, "master": line.split()[3]}
            node = [sys.executable, "-m", "mori.umbp.bench._node"]
            store = _Proc(
                "mori storage node",
                store_host.command(
                    [*node, "store", json.dumps({**common, "address": store_host.address, "ssd_dir": ssd_dir})]
                ),
                out / f"{label}-store.log",
                stdin=True,
                env=env,
            )
            procs.append(store)
            store.next(START_TIMEOUT_S)
            client = _Proc(
                "mori client node",
                client_host.command(
                    [*node, "client", json.dumps({**common, "address": client_host.address, "ssd": True})]
                ),
                out / f"{label}-client.log",
                stdin=True,
                env=env,
            )
            procs.append(client)
            return _relay(client, store, timeout, label)
    finally:
        shutil.rmtree(ssd_dir, ignore_errors=True)


def _mooncake(
    net: list[Host], plan: dict[str, Any], out: Path, peer_python: str, ssd_root: str, timeout: float
) -> list[dict[str, Any]]:
    """Mooncake's points: the memory group on processes without offload, the SSD group on
    processes with it (its eager offload writes each object put to disk in the background)."""
    rows = []
    for group in plan["groups"]:
        if group == "memory":
            rows += _mooncake_group(net, {**plan, "groups": ["memory"]}, out, peer_python, "", timeout)
        else:
            ssd_dir = tempfile.mkdtemp(prefix="mooncake-bench-ssd-", dir=ssd_root)
            try:
                rows += _mooncake_group(net, {**plan, "groups": ["ssd"]}, out, peer_python, ssd_dir, timeout)
            finally:
                shutil.rmtree(ssd_dir, ignore_errors=True)
    return rows


def _mooncake_group(
    net: list[Host], plan: dict[str, Any], out: Path, peer_python: str, ssd_dir: str, timeout: float
) -> list[dict[str, Any]]:
    """One set of Mooncake's processes running ``plan``'s points; with ``ssd_dir``, the master's
    offload on (objects are queued for disk at each put's end, not at eviction), leases of 1 ms
    (so the client may clear a memory replica at once), and the storage node's disk tier there."""
    master_host, client_host, store_host = net
    binary = Path(peer_python).with_name("mooncake_master")
    if not binary.exists():
        raise RuntimeError(f"{binary} is missing: install mooncake-transfer-engine-non-cuda beside {peer_python}")
    offload = ["--enable_offload=true", "--default_kv_lease_ttl=1"] if ssd_dir else []
    suffix = "-ssd" if ssd_dir else ""
    with _processes() as procs:
        a = master_host.address
        procs.append(
            _Proc(
                "mooncake master",
                master_host.command(
                    [
                        str(binary),
                        f"--rpc_address={a}",
                        f"--rpc_port={MC_RPC_PORT}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={a}",
                        f"--http_metadata_server_port={MC_HTTP_PORT}",
                        f"--metrics_port={MC_METRICS_PORT}",
                        *offload,
                    ]
                ),
                out / f"mooncake{suffix}-master.log",
            )
        )
        common = {**plan, "master_host": a, "rpc_port": MC_RPC_PORT, "http_port": MC_HTTP_PORT}
        node = [peer_python, str(HERE / "_mooncake_node.py")]
        store = _Proc(
            "mooncake storage node",
            store_host.command(
                [*node, "store", json.dumps({**common, "address": store_host.address, "ssd_dir": ssd_dir})]
            ),
            out / f"mooncake{suffix}-store.log",
            stdin=True,
        )
        procs.append(store)
        store.next(START_TIMEOUT_S)
        client = _Proc(
            "mooncake client node",
            client_host.command([*node, "client", json.dumps({**common, "address": client_host.address})]),
            out / f"mooncake{suffix}-client.log",
            stdin=True,
        )
        procs.append(client)
        return _relay(client, store, timeout, "mooncake")


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    value = int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)
    if value <= 0 or value % 4096:
        raise argparse.ArgumentTypeError(f"page size {text!r}: a positive multiple of 4 KiB")
    return value


def _over_rounds(rounds: list[dict[str, list[dict[str, Any]]]]) -> dict[str, list[dict[str, Any]]]:
    """Each system's rows with the median over rounds of each round's median (and its GB/s)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for system, rows in rounds[0].items():
        merged = []
        for i, row in enumerate(rows):
            medians = [r[system][i]["median_us"] for r in rounds]
            us = statistics.median(medians)
            merged.append(
                {
                    **row,
                    "median_us": us,
                    "round_medians_us": medians,
                    "gbps": None if row["gbps"] is None else row["pages"] * row["size"] / (us * 1e3),
                    "min_us": min(r[system][i]["min_us"] for r in rounds),
                }
            )
        out[system] = merged
    return out


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    systems = list(results)
    by_point: dict[str, dict[str, dict[str, Any]]] = {}
    for system, rows in results.items():
        for row in rows:
            by_point.setdefault(row["point"], {})[system] = row
    head = "| point | " + " | ".join(f"{s} µs | {s} GB/s" for s in systems)
    if len(systems) > 1:
        head += " | " + " | ".join(f"{systems[0]} / {s}" for s in systems[1:])
    lines = [head + " |", "|---" + "|---:" * (2 * len(systems) + len(systems) - 1) + "|"]
    for point, cells in by_point.items():
        parts = [point]
        for s in systems:
            cell = cells.get(s)
            parts += (
                ["—", "—"]
                if cell is None
                else [f"{cell['median_us']:.1f}", "" if cell["gbps"] is None else f"{cell['gbps']:.3f}"]
            )
        mine = cells.get(systems[0])
        for s in systems[1:]:
            peer = cells.get(s)
            parts.append("—" if mine is None or peer is None else f"{peer['median_us'] / mine['median_us']:.2f}×")
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def _commit() -> str:
    proc = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mori-umbp-bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64K,1M", help="page sizes, comma-separated (default 64K,1M)")
    parser.add_argument("--pages", type=int, default=64, help="pages per batch (default 64)")
    parser.add_argument("--exists-keys", type=int, default=1024, help="keys per batch_exists (default 1024)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per point (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations before them (default 3)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds of every system in turn; each point's figure is the median of its rounds' (default 1)",
    )
    parser.add_argument("--peers", default="mooncake", help="peer systems: 'mooncake' or '' (mori alone)")
    parser.add_argument(
        "--mori-grpc",
        default="auto",
        help="mori's gRPC transports, comma-separated, each a system of the run: auto (the C++ one where "
        "built, else grpcio), native, python (grpcio: 'mori-grpcio') (default auto)",
    )
    parser.add_argument(
        "--points",
        default="all",
        choices=["all", "ssd"],
        help="all the points, or the SSD gets alone (default all)",
    )
    parser.add_argument("--peer-python", default="python3", help="an interpreter with Mooncake installed")
    parser.add_argument("--ssd-dir", default=None, help="where the storage node's SSD tier goes (default: $TMPDIR)")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest wait for one point, seconds")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--logs", default="", help="the processes' logs go here (default: a temporary folder)")
    args = parser.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := [p for p in peers if p != "mooncake"]:
        parser.error(f"--peers: unknown {unknown}; the one peer is mooncake")
    transports = [t.strip() for t in args.mori_grpc.split(",") if t.strip()]
    labels = [_MORI_SYSTEMS.get(t) for t in transports]
    if not transports or None in labels or len(set(labels)) != len(labels):
        parser.error(f"--mori-grpc {args.mori_grpc!r}: one to two of auto or native, and python")
    if min(args.pages, args.iters, args.exists_keys, args.rounds) < 1 or args.warmup < 0:
        parser.error("--pages, --iters, --exists-keys and --rounds must be positive, --warmup not negative")
    need = capacity_needed(sizes, args.pages, args.iters, args.warmup, args.exists_keys)
    capacity = (int(need / 0.7) + (64 << 20)) // (1 << 20) * (1 << 20)  # under both systems' eviction watermarks
    ssd_capacity = max(256 << 20, -(-2 * args.pages * sum(sizes) // (64 << 20)) * (64 << 20))
    plan = {
        "sizes": sizes,
        "pages": args.pages,
        "iters": args.iters,
        "warmup": args.warmup,
        "exists_keys": args.exists_keys,
        "capacity": capacity,
        "ssd_capacity": ssd_capacity,
        "groups": list(GROUPS) if args.points == "all" else ["ssd"],
    }
    out = Path(args.logs or tempfile.mkdtemp(prefix="umbp-bench-logs-"))
    out.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, list[dict[str, Any]]]] = []
    with hosts(3) as net:
        print(
            f"master {net[0].address}, client node {net[1].address}, storage node {net[2].address}; logs in {out}",
            flush=True,
        )
        for r in range(args.rounds):  # the systems take turns, so a change of load falls on both
            print(f"round {r + 1} of {args.rounds}", flush=True)
            results = {
                _MORI_SYSTEMS[t]: _mori(net, plan, out, args.ssd_dir or tempfile.gettempdir(), args.timeout, t)
                for t in transports
            }
            if "mooncake" in peers:
                ssd_root = args.ssd_dir or tempfile.gettempdir()
                results["Mooncake"] = _mooncake(net, plan, out, args.peer_python, ssd_root, args.timeout)
            rounds.append(results)
    results = _over_rounds(rounds)
    table = _table(results)
    print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "benchmark": "mori-umbp-bench",
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "commit": _commit(),
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "args": vars(args),
                    "plan": plan,
                    "results": results,
                    "rounds": rounds,
                    "table": table,
                },
                indent=1,
            )
        )
    return 0
