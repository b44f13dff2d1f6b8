"""Peer transfer engines measured in the same benchmark run: Mooncake Transfer Engine and NIXL.

Runs as a script under ``--peer-python`` (an interpreter where the peer is installed: NIXL pins
its own torch, which cannot share mori's environment), so it imports nothing from mori:
``python _peers.py ENGINE initiator HOST OP ITERS WARMUP POINTS_JSON`` prints one JSON row per
point; it starts ``python _peers.py ENGINE target HOST SIZE`` as the other process itself.
Both peers run over TCP on loopback (Mooncake's ``tcp`` transport; NIXL's UCX backend with
``UCX_TLS=tcp``) so the comparison with mori's TCP backend is like for like.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import block_layout, summarize  # noqa: E402

os.environ.setdefault("UCX_TLS", "tcp,self")
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOG_minloglevel", "2")


MARK = "@@mori-bench "  # peers' libraries log to stdout too: our lines carry this mark


def _send(obj: Any) -> None:
    print(MARK + json.dumps(obj), flush=True)


def read_marked(stream: Any) -> Any:
    """The next marked JSON object on ``stream`` (other lines are the peer library's logging)."""
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    return None


def _buffer(size: int) -> Any:
    import numpy as np

    return np.ones(size, dtype=np.uint8)


# ---- Mooncake ------------------------------------------------------------------------------------
def mooncake_target(host: str, size: int) -> None:
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if eng.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    buf = _buffer(size)
    eng.register_memory(int(buf.ctypes.data), size)
    _send({"addr": int(buf.ctypes.data), "name": f"{host}:{eng.get_rpc_port()}"})
    sys.stdin.read()


def mooncake_initiator(host: str, op: str, points: list[tuple[int, int]], iters: int, warmup: int,
                       target: dict[str, Any]) -> None:
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    if eng.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake: initialize failed")
    need = max(s * b for s, b in points)
    buf = _buffer(need)
    base = int(buf.ctypes.data)
    eng.register_memory(base, need)
    fn = eng.batch_transfer_sync_read if op == "read" else eng.batch_transfer_sync_write
    for size, batch in points:
        l_offs, r_offs = block_layout(size, batch)
        local = [base + o for o in l_offs]
        remote = [target["addr"] + o for o in r_offs]
        sizes = [size] * batch
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            if fn(target["name"], local, remote, sizes) != 0:
                raise SystemExit("mooncake: transfer failed")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        _send(summarize(size, batch, times))


# ---- NIXL ----------------------------------------------------------------------------------------
def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def nixl_target(host: str, size: int) -> None:
    agent = _nixl_agent("nixl-target")
    buf = _buffer(size)
    reg = agent.register_memory([(int(buf.ctypes.data), size, 0, "")], "DRAM")
    assert reg is not None
    _send({"addr": int(buf.ctypes.data), "meta": agent.get_agent_metadata().hex()})
    sys.stdin.read()


def nixl_initiator(host: str, op: str, points: list[tuple[int, int]], iters: int, warmup: int,
                   target: dict[str, Any]) -> None:
    agent = _nixl_agent("nixl-initiator")
    peer = agent.add_remote_agent(bytes.fromhex(target["meta"]))
    need = max(s * b for s, b in points)
    buf = _buffer(need)
    base = int(buf.ctypes.data)
    agent.register_memory([(base, need, 0, "")], "DRAM")
    for size, batch in points:
        l_offs, r_offs = block_layout(size, batch)
        local = agent.get_xfer_descs([(base + o, size, 0) for o in l_offs], "DRAM")
        remote = agent.get_xfer_descs([(target["addr"] + o, size, 0) for o in r_offs], "DRAM")
        handle = agent.initialize_xfer("READ" if op == "read" else "WRITE", local, remote, peer)
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise SystemExit("nixl: transfer failed")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        agent.release_xfer_handle(handle)
        _send(summarize(size, batch, times))


ENGINES = {"mooncake": (mooncake_target, mooncake_initiator), "nixl": (nixl_target, nixl_initiator)}


def main() -> None:
    engine, role, host = sys.argv[1], sys.argv[2], sys.argv[3]
    target_fn, initiator_fn = ENGINES[engine]
    if role == "target":
        target_fn(host, int(sys.argv[4]))
        return
    op, iters, warmup = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    points = [tuple(p) for p in json.loads(sys.argv[7])]
    need = max(s * b for s, b in points)
    proc = subprocess.Popen([sys.executable, __file__, engine, "target", host, str(need)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        info = read_marked(proc.stdout)
        if info is None:
            raise SystemExit(f"{engine}: target did not start")
        initiator_fn(host, op, points, iters, warmup, info)  # type: ignore[arg-type]
    finally:
        proc.kill()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
