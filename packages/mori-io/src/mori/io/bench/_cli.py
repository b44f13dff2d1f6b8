"""``mori-io-bench`` / ``python -m mori.io.bench``: sweeps message and batch sizes like MORI's
benchmark, prints MaxBW/AvgBW (GB/s) and MinLat/AvgLat (us), optionally beside peers measured in
the same run, and writes JSON and a bandwidth plot."""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mori.core.config import parse_size

from ..types import RdmaBackendConfig, TcpBackendConfig
from ._fan_in import run_fan_in
from ._mori_runner import gpu_of, run_mori
from ._peers import MARK

__all__ = ["BACKENDS", "backend_config", "backend_env", "engine_label", "main", "parse_args", "run_peer"]

DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M"
PEERS = ("mooncake", "nixl")


def _sizes(text: str) -> list[int]:
    try:
        out = [parse_size(t, "size") for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive sizes such as 4K,64K,1M")
    return out


def _ints(text: str) -> list[int]:
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers such as 1,64,4096") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return out


BACKENDS = ("tcp", "rdma", "rdma-ucx")


def _backends(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or any(n not in BACKENDS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: expected backends among {','.join(BACKENDS)}")
    return names


@contextlib.contextmanager
def backend_env(backend: str) -> Iterator[None]:
    """The environment of a backend's runs (the processes they start inherit it): ``rdma-ucx`` is
    the RDMA backend kept on UCX's transports between engines of one host
    (``MORI_IO_RDMA_SAME_HOST=0``)."""
    if backend != "rdma-ucx":
        yield
        return
    before = os.environ.get("MORI_IO_RDMA_SAME_HOST")
    os.environ["MORI_IO_RDMA_SAME_HOST"] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MORI_IO_RDMA_SAME_HOST")
        else:
            os.environ["MORI_IO_RDMA_SAME_HOST"] = before


def backend_config(args: argparse.Namespace, backend: str) -> TcpBackendConfig | RdmaBackendConfig:
    """The backend's configuration from the command line."""
    if backend.startswith("rdma"):
        return RdmaBackendConfig(qp_per_transfer=args.num_qp_per_transfer, num_worker_threads=args.num_worker_threads)
    return TcpBackendConfig(num_connections=args.num_connections)


def _peers(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown peer(s) {bad}; available: {', '.join(PEERS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="mori-io-bench", description=__doc__)
    p.add_argument("--op", choices=["read", "write"], default="write")
    p.add_argument("--sizes", type=_sizes, default=_sizes(DEFAULT_SIZES), help=f"block sizes (default {DEFAULT_SIZES})")
    p.add_argument("--batch-sizes", type=_ints, default=[1], help="blocks per transfer, e.g. 1,64,4096 (default 1)")
    p.add_argument("--session", action="store_true", help="use an IOEngineSession instead of engine calls")
    p.add_argument("--iters", type=int, default=50, help="timed transfers per point (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed transfers first (default 5)")
    p.add_argument("--host", default="127.0.0.1", help="address both engines use (default loopback)")
    p.add_argument(
        "--backend",
        type=_backends,
        default=["tcp"],
        help="mori backends to measure, e.g. tcp,rdma (rdma: UCX over MORI_IO_RDMA_TRANSPORTS, and the same-host "
        "path between engines of one host; rdma-ucx: the RDMA backend without that path; default tcp)",
    )
    p.add_argument(
        "--fan-in",
        type=int,
        default=0,
        metavar="N",
        help="instead of the sweep: one target serving N initiator processes at once, against it serving one "
        "(aggregate GB/s per point, host memory)",
    )
    p.add_argument("--target-host", help="address of the target engines (default --host)")
    p.add_argument(
        "--target-netns",
        help="network namespace the targets run in (ip netns; needs root): with "
        "--target-host, initiator and targets are two 'hosts'",
    )
    p.add_argument(
        "--num-connections",
        type=int,
        default=TcpBackendConfig().num_connections,
        help="TCP data connections per peer (default: TcpBackendConfig's, half the CPUs, 1..4)",
    )
    p.add_argument(
        "--num-qp-per-transfer",
        type=int,
        default=RdmaBackendConfig().qp_per_transfer,
        help="RDMA: lanes (queue pairs) per peer and worker (default: RdmaBackendConfig's, 1)",
    )
    p.add_argument(
        "--num-worker-threads",
        type=int,
        default=RdmaBackendConfig().num_worker_threads,
        help="RDMA: UCX workers, each with its progress thread; a transfer of 512 KiB or more is "
        "spread over them (default: RdmaBackendConfig's, -1: one)",
    )
    p.add_argument(
        "--mem-type",
        choices=["cpu", "gpu"],
        default="cpu",
        help="memory of both sides, as MORI's benchmark: cpu (host memory) or gpu (torch tensors; the "
        "target on GPU 0, the initiator on the last GPU; the peers too) (default cpu)",
    )
    p.add_argument(
        "--max-bytes",
        type=_sizes,
        default=[256 << 20],
        help="skip points moving more than this per transfer (default 256M)",
    )
    p.add_argument("--peers", type=_peers, default=[], help="also measure: mooncake,nixl (same sizes, same run)")
    p.add_argument(
        "--peer-python",
        default=sys.executable,
        help="interpreter where the peers are installed (NIXL pins its own torch)",
    )
    p.add_argument("--json", type=Path, help="write every row to this JSON file")
    p.add_argument("--plot", type=Path, help="draw bandwidth against size into this image (matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.fan_in < 0 or (args.fan_in and (args.peers or args.mem_type != "cpu" or args.session)):
        p.error("--fan-in N takes N >= 1, host memory, and no --peers or --session")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install 'mori-io[bench]'")
    return args


class _NoBar:
    """Stands in for a tqdm bar when there is none."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, label: str, disabled: bool) -> Any:
    """A tqdm bar on stderr, or none with ``--no-progress`` (then tqdm is not needed)."""
    if disabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        print(
            "mori-io-bench: no progress bar (tqdm is not installed: pip install 'mori-io[bench]', "
            "or pass --no-progress)",
            file=sys.stderr,
        )
        return _NoBar()
    return tqdm(total=total, desc=label, file=sys.stderr)


def engine_label(backend: str) -> str:
    """A backend's name in the rows: ``mori`` (TCP), ``mori-rdma``, ``mori-rdma-ucx``."""
    return "mori" if backend == "tcp" else f"mori-{backend}"


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON values: numbers stay numbers, lists lists, paths strings."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def run_peer(
    name: str,
    python: str,
    host: str,
    op: str,
    iters: int,
    warmup: int,
    points: list[tuple[int, int]],
    env: dict[str, str] | None = None,
    log: Path | None = None,
) -> tuple[list[dict[str, Any]], str]:
    """Measures another transfer engine, ``name`` (``"mooncake"`` or ``"nixl"``), as the benchmark's
    ``--peers`` does: its initiator and target run under the interpreter ``python`` (one where
    that engine is installed), on ``host``, with environment ``env`` (``MORI_PEER_GPUS=T,I``: GPU
    memory of GPUs ``T`` and ``I`` instead of host memory). ``op`` is ``"read"`` or ``"write"``,
    ``points`` the (block size, blocks per transfer) pairs, each timed ``iters`` times after
    ``warmup`` untimed transfers. Returns its rows (the keys of mori's rows) and a note saying why
    it failed, empty when it did not; ``log`` receives the peer's whole output."""
    script = Path(__file__).with_name("_peers.py")
    cmd = [python, str(script), name, "initiator", host, op, str(iters), str(warmup), json.dumps(points)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        return [], f"{name}: could not run ({err})"
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    rows = [json.loads(line[len(MARK) :]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if len(rows) == len(points) and proc.returncode != 0:
        return rows, f"{name}: exited with rc={proc.returncode} after reporting every point (teardown crash)"
    if proc.returncode != 0 or len(rows) != len(points):
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return rows, f"{name}: failed (rc={proc.returncode}): {' | '.join(tail)}"
    return rows, ""


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'engine':10} {'op':5} {'size':>9} {'batch':>6} {'MaxBW GB/s':>11} {'AvgBW GB/s':>11} "
        f"{'MinLat us':>10} {'AvgLat us':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r["batch"], r["size"], r["engine"])):
        lines.append(
            f"{r['engine']:10} {r['op']:5} {r['size']:>9} {r['batch']:>6} {r['max_bw_gbs']:>11.3f} "
            f"{r['avg_bw_gbs']:>11.3f} {r['min_lat_us']:>10.1f} {r['avg_lat_us']:>10.1f}"
        )
    return "\n".join(lines)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for key in sorted({(r["engine"], r["batch"]) for r in rows}):
        pts = sorted((r["size"], r["avg_bw_gbs"]) for r in rows if (r["engine"], r["batch"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} batch={key[1]}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (bytes)")
    ax.set_ylabel("average bandwidth (GB/s)")
    ax.set_title(f"mori-io {rows[0]['op'] if rows else ''} over TCP")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def fan_in_main(args: argparse.Namespace, points: list[tuple[int, int]], notes: list[str]) -> int:
    """``--fan-in N``: per backend and point, one initiator's aggregate GB/s through one target,
    N initiators' at once, and the ratio; the table on stdout, the rows in ``--json``."""
    rows = []
    for backend in args.backend:
        print(f"measuring {engine_label(backend)}: 1 and {args.fan_in} initiators ...", file=sys.stderr)
        with backend_env(backend):
            measured = run_fan_in(
                args.fan_in,
                points,
                args.op,
                args.iters,
                args.warmup,
                args.host,
                backend_config(args, backend),
                backend,
                args.target_host,
                args.target_netns,
            )
        rows += [{"engine": engine_label(backend), "op": args.op, **r} for r in measured]
    head = (
        f"{'engine':14} {'op':5} {'size':>9} {'batch':>6} {'1 init GB/s':>12} "
        f"{str(args.fan_in) + ' init GB/s':>12} {'ratio':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['engine']:14} {r['op']:5} {r['size']:>9} {r['batch']:>6} {r['one_gbs']:>12.3f} "
            f"{r['fan_in_gbs']:>12.3f} {r['ratio']:>7.1%}"
        )
    print("\n".join(lines))
    for note in notes:
        print("note:", note)
    if args.json:
        args.json.write_text(json.dumps({"args": _json_args(args), "rows": rows, "notes": notes}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns the process exit code."""
    args = parse_args(argv)
    points = [(s, b) for b in args.batch_sizes for s in args.sizes if s * b <= args.max_bytes[0]]
    skipped = [(s, b) for b in args.batch_sizes for s in args.sizes if s * b > args.max_bytes[0]]
    notes = (
        [f"skipped (size x batch over --max-bytes {args.max_bytes[0]}): " + ", ".join(f"{s}x{b}" for s, b in skipped)]
        if skipped
        else []
    )
    if not points:
        print(f"mori-io-bench: every point exceeds --max-bytes ({notes[0]})", file=sys.stderr)
        return 2
    if args.fan_in:
        return fan_in_main(args, points, notes)
    peer_gpus = f"{gpu_of('target')},{gpu_of('initiator')}" if args.mem_type == "gpu" else ""
    rows = []
    for backend in args.backend:
        label = engine_label(backend)
        bar = _progress(len(points), label, args.no_progress)
        with backend_env(backend):
            measured = run_mori(
                points,
                args.op,
                args.session,
                args.iters,
                args.warmup,
                args.host,
                backend_config(args, backend),
                functools.partial(bar.update, 1),
                backend,
                args.target_host,
                args.target_netns,
                args.mem_type,
            )
            rows += [{"engine": label, "op": args.op, "session": args.session, **row} for row in measured]
        bar.close()
    for name in args.peers:
        print(f"measuring peer {name} ...", file=sys.stderr)
        env = dict(os.environ)
        if peer_gpus:
            env["MORI_PEER_GPUS"] = peer_gpus
        if args.target_netns:
            env.update(MORI_PEER_TARGET_NETNS=args.target_netns, MORI_PEER_TARGET_HOST=args.target_host or args.host)
        peer_rows, note = run_peer(name, args.peer_python, args.host, args.op, args.iters, args.warmup, points, env)
        rows += [{"engine": name, "op": args.op, **r} for r in peer_rows]
        if note:
            notes.append(note)
    print(_table(rows))
    for note in notes:
        print("note:", note)
    if args.json:
        args.json.write_text(json.dumps({"args": _json_args(args), "rows": rows, "notes": notes}, indent=1))
    if args.plot:
        _plot(rows, args.plot)
    return 0
