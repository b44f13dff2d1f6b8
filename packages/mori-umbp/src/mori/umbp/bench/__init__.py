"""``python -m mori.umbp.bench``: mori's UMBP against Mooncake Store, between two network
namespaces over TCP, in the same run.

Namespace B holds the owner: the master (``mori-umbp-master``; ``mooncake_master``) and a node
with room for every page; namespace A holds the client, a node with (next to) none, so every page
it puts goes to B and every get comes back from B. Measured in A, per page size (64 pages a
batch): a batch put and a batch get (median over ``--iters`` batches of fresh keys, the bytes
checked), and ``batch_exists`` of 1,024 keys, half of them present. Then, for mori, a get that
hits SSD: a one-node pool whose DRAM holds a few pages, the time of a get of a page that went to
SSD (staged back into DRAM; each page measured once). Mooncake Store runs with the Python of
``--peer-python``, an environment with ``mooncake-transfer-engine`` (``ci/umbp-bench.sh`` makes
one). Needs root and iproute2 (the namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mori.core.testing import network_namespaces

from .._config import UMBPConfig, UMBPDistributedConfig
from .._enums import UMBPTierType

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _node(master: str, node_id: str, host: str, dram: int) -> Any:
    from .._client import UMBPClient

    cfg = UMBPConfig()
    cfg.dram.capacity_bytes, cfg.dram.prefault, cfg.ssd.enabled = dram, False, False
    cfg.distributed = UMBPDistributedConfig()
    cfg.distributed.master_config.master_address = master
    cfg.distributed.master_config.node_id = node_id
    cfg.distributed.master_config.node_address = host
    cfg.distributed.cache_remote_fetches = False  # every get crosses (MORI's advice for benchmarks)
    return UMBPClient(cfg)


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples) * 1000)


def role_owner(spec: dict[str, Any]) -> None:
    """The master and a node with room for every page, on ``host``; serves until stdin closes."""
    script = Path(sys.executable).with_name("mori-umbp-master")
    master = subprocess.Popen([str(script), f"{spec['host']}:0", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert master.stdout is not None
        address = master.stdout.readline().split()[3]
        node = _node(address, "owner", spec["host"], spec["segment"])
        print(json.dumps({"master": address}), flush=True)
        sys.stdin.read()
        node.close()
    finally:
        master.terminate()
        master.wait(30)


def role_client(spec: dict[str, Any]) -> None:
    """The measurements of mori's client (see the module's docstring); one JSON line."""
    client = _node(spec["master"], "client", spec["host"], 4 * MiB)
    out: dict[str, Any] = {"engine": "mori", "points": []}
    keys_all: list[str] = []
    for size in spec["sizes"]:
        n = spec["pages"]
        src = np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)
        dst = np.zeros_like(src)
        for buf in (src, dst):
            client.register_memory(int(buf.ctypes.data), buf.nbytes)
        ptrs = [int(src.ctypes.data) + i * size for i in range(n)]
        dptrs = [int(dst.ctypes.data) + i * size for i in range(n)]
        puts, gets = [], []
        for it in range(spec["iters"]):
            keys = [f"mori-{size}-{it}-{i}" for i in range(n)]
            keys_all += keys
            t0 = time.perf_counter()
            put = client.batch_put_from_ptr(keys, ptrs, [size] * n)
            t1 = time.perf_counter()
            got = client.batch_get_into_ptr(keys, dptrs, [size] * n)
            t2 = time.perf_counter()
            if not all(put) or not all(got):
                raise SystemExit(f"mori: put {put.count(False)} failed, get {got.count(False)} failed")
            puts.append(t1 - t0)
            gets.append(t2 - t1)
        if not np.array_equal(src, dst):
            raise SystemExit("mori: bytes differ")
        if client.stats()["keys"]:
            raise SystemExit("mori: pages stayed on the client's node: the owner was not routed to")
        out["points"].append({"size": size, "pages": n, "put_ms": _median_ms(puts), "get_ms": _median_ms(gets)})
        for buf in (src, dst):
            client.deregister_memory(int(buf.ctypes.data))
    probe = (keys_all * (spec["exists"] // max(1, len(keys_all)) + 1))[:spec["exists"] // 2]
    probe += [f"absent-{i}" for i in range(spec["exists"] - len(probe))]
    samples = []
    for _ in range(spec["iters"]):
        t0 = time.perf_counter()
        found = client.batch_exists(probe)
        samples.append(time.perf_counter() - t0)
    if sum(found) != spec["exists"] // 2:
        raise SystemExit("mori: batch_exists miscounted")
    out["exists_ms"] = _median_ms(samples)
    out["ssd_get_ms"] = {str(size): _ssd_hit(size) for size in spec["sizes"]}
    print(json.dumps(out), flush=True)
    client.close()


def _ssd_hit(size: int, pages: int = 32) -> float:
    """Median time of a get whose page is on SSD (one node; DRAM holds 4 pages)."""
    from .._client import UMBPClient

    with tempfile.TemporaryDirectory(dir=os.environ.get("UMBP_BENCH_SSD_DIR")) as directory:
        cfg = UMBPConfig()
        cfg.dram.capacity_bytes, cfg.dram.prefault = 4 * size, False
        cfg.ssd.storage_dir, cfg.ssd.capacity_bytes = directory, 2 * pages * size + 64 * MiB
        cfg.ssd.segment_size_bytes = max(16 * MiB, size)
        src = np.random.default_rng(1).integers(0, 256, (pages, size), dtype=np.uint8)
        dst = np.zeros(size, np.uint8)
        with UMBPClient(cfg) as pool:
            keys = [f"ssd-{i}" for i in range(pages)]
            assert all(pool.batch_put_from_ptr(keys, [int(src.ctypes.data) + i * size for i in range(pages)],
                                               [size] * pages))
            assert pool.flush()
            store = pool._store
            assert store is not None
            samples = []
            for i, key in enumerate(keys):
                if store.lookup(key) != (UMBPTierType.SSD, size):
                    continue
                t0 = time.perf_counter()
                ok = pool.get_into_ptr(key, int(dst.ctypes.data), size)
                samples.append(time.perf_counter() - t0)
                if not ok or not np.array_equal(dst, src[i]):
                    raise SystemExit("mori: an SSD hit returned other bytes")
            return _median_ms(samples)


def _start(netns: str, python: str, args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["ip", "netns", "exec", netns, python, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _line(proc: subprocess.Popen[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"{what} exited ({proc.wait(30)}) before answering")
    return line


def run(sizes: list[int], pages: int, iters: int, exists: int, peer_python: str | None) -> list[dict[str, Any]]:
    """Both engines' results, mori's first."""
    results = []
    with network_namespaces("10.233.41") as (a, b):
        common = {"sizes": sizes, "pages": pages, "iters": iters, "exists": exists,
                  "segment": 2 * pages * max(sizes) * iters + 256 * MiB}
        engines = [("mori", sys.executable, ["-m", "mori.umbp.bench"])]
        if peer_python:
            engines.append(("mooncake", peer_python, [str(HERE / "_mooncake.py")]))
        for name, python, prefix in engines:
            owner = _start(b.name, python, [*prefix, json.dumps({**common, "role": "owner", "host": b.address})])
            try:
                first = _line(owner, f"{name}'s owner")
                master = json.loads(first)["master"] if name == "mori" else b.address
                client = _start(a.name, python, [*prefix, json.dumps({**common, "role": "client", "host": a.address,
                                                                      "master": master})])
                results.append(json.loads(_line(client, f"{name}'s client")))
                client.wait(60)
            finally:
                assert owner.stdin is not None
                owner.stdin.close()
                owner.wait(60)
    return results


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # a role in a namespace
        spec = json.loads(sys.argv[1])
        {"owner": role_owner, "client": role_client}[spec["role"]](spec)
        return 0
    parser = argparse.ArgumentParser(prog="python -m mori.umbp.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64K,1M", help="page sizes (default 64K,1M)")
    parser.add_argument("--pages", type=int, default=64, help="pages a batch (default 64)")
    parser.add_argument("--iters", type=int, default=10, help="batches per point (default 10)")
    parser.add_argument("--exists", type=int, default=1024, help="keys a batch_exists (default 1024)")
    parser.add_argument("--peer-python", help="Python with mooncake-transfer-engine, for Mooncake Store")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = run([_size(s) for s in args.sizes.split(",")], args.pages, args.iters, args.exists, args.peer_python)
    print(f"{'engine':10} {'page':>6} {'batch put ms':>13} {'batch get ms':>13}")
    for result in results:
        for p in result["points"]:
            print(f"{result['engine']:10} {p['size'] >> 10:>5}K {p['put_ms']:>13.2f} {p['get_ms']:>13.2f}")
    for result in results:
        print(f"{result['engine']:10} batch_exists of {args.exists} keys: {result['exists_ms']:.2f} ms")
        for size, ms in result.get("ssd_get_ms", {}).items():
            print(f"{result['engine']:10} get that hits SSD, {int(size) >> 10}K page: {ms:.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0
