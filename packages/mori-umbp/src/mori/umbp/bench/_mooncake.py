"""Mooncake Store's side of the UMBP benchmark: run by path with the Python of an environment that
has ``mooncake-transfer-engine`` (and numpy), never imported by mori. Roles:

- ``owner``: ``mooncake_master`` (with its HTTP metadata server) and a store process that mounts
  a large segment, on this host's address; prints ``ready``, serves until stdin closes;
- ``client``: a store that mounts no memory of its own, so every page goes to the owner; the same
  measurements as mori's client (see ``mori.umbp.bench``); prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from mooncake.store import MooncakeDistributedStore

RPC_PORT, HTTP_PORT = 50151, 50152


def _store(host: str, master_host: str, segment: int, local_buffer: int) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup(host, f"http://{master_host}:{HTTP_PORT}/metadata", segment, local_buffer, "tcp", "",
                     f"{master_host}:{RPC_PORT}")
    if rc != 0:
        raise SystemExit(f"mooncake: setup failed ({rc})")
    return store


def owner(args: dict) -> None:
    binary = Path(sys.executable).with_name("mooncake_master")
    master = subprocess.Popen([str(binary), f"--rpc_port={RPC_PORT}", f"--rpc_address={args['host']}",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_host={args['host']}",
                               f"--http_metadata_server_port={HTTP_PORT}", "--metrics_port=0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                store = _store(args["host"], args["host"], args["segment"], 16 << 20)
                break
            except SystemExit:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        print("ready", flush=True)
        sys.stdin.read()
        store.close()
    finally:
        master.terminate()
        master.wait(30)


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples) * 1000)


def client(args: dict) -> None:
    store = _store(args["host"], args["master"], 0, 512 << 20)
    out: dict = {"engine": "mooncake", "points": []}
    for size in args["sizes"]:
        n = args["pages"]
        src = np.random.default_rng(size).integers(0, 256, (n, size), dtype=np.uint8)
        dst = np.zeros_like(src)
        for buf in (src, dst):
            if store.register_buffer(int(buf.ctypes.data), buf.nbytes) != 0:
                raise SystemExit("mooncake: register_buffer failed")
        ptrs = [int(src.ctypes.data) + i * size for i in range(n)]
        dptrs = [int(dst.ctypes.data) + i * size for i in range(n)]
        puts, gets, keys_all = [], [], []
        for it in range(args["iters"]):
            keys = [f"mc-{size}-{it}-{i}" for i in range(n)]
            keys_all += keys
            t0 = time.perf_counter()
            rc = store.batch_put_from(keys, ptrs, [size] * n)
            t1 = time.perf_counter()
            got = store.batch_get_into(keys, dptrs, [size] * n)
            t2 = time.perf_counter()
            if any(r != 0 for r in rc) or any(g != size for g in got):
                raise SystemExit(f"mooncake: put {rc[:4]} get {got[:4]}")
            puts.append(t1 - t0)
            gets.append(t2 - t1)
        if not np.array_equal(src, dst):
            raise SystemExit("mooncake: bytes differ")
        out["points"].append({"size": size, "pages": n, "put_ms": _median_ms(puts), "get_ms": _median_ms(gets)})
        for buf in (src, dst):
            store.unregister_buffer(int(buf.ctypes.data))
    probe = (keys_all * (args["exists"] // max(1, len(keys_all)) + 1))[:args["exists"] // 2]
    probe += [f"absent-{i}" for i in range(args["exists"] - len(probe))]
    samples = []
    for _ in range(args["iters"]):
        t0 = time.perf_counter()
        found = store.batch_is_exist(probe)
        samples.append(time.perf_counter() - t0)
    if sum(1 for f in found if f == 1) != args["exists"] // 2:
        raise SystemExit("mooncake: batch_is_exist miscounted")
    out["exists_ms"] = _median_ms(samples)
    print(json.dumps(out), flush=True)
    store.close()


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    {"owner": owner, "client": client}[spec["role"]](spec)
