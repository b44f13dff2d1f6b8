"""Peer transfer engines measured in the same benchmark run: Mooncake Transfer Engine and NIXL.

Runs as a script under ``--peer-python`` (an interpreter where the peer is installed: NIXL pins
its own torch, which cannot share mori's environment), so it imports nothing from mori:
``python _peers.py ENGINE initiator HOST OP ITERS WARMUP POINTS_JSON`` prints one JSON row per
point; it starts ``python _peers.py ENGINE target HOST SIZE`` as the other process itself.
By default both peers move host memory over TCP on loopback (Mooncake's ``tcp`` transport;
NIXL's UCX backend with ``UCX_TLS=tcp``) so the comparison with mori's TCP backend is like for
like. With ``MORI_PEER_GPUS=T,I`` they move GPU memory between GPU ``T`` (target) and GPU ``I``
(initiator) of one host instead, as mori's NVLink backend does: Mooncake's ``nvlink_intra``
transport and NIXL's UCX backend with its CUDA transports (torch tensors as buffers). There the
target's memory holds a known pattern and every read point is checked against it after timing.
Wherever ``MORI_IO_RDMA_TRANSPORTS`` is set (against mori's RDMA backend, e.g. ``mori-io-bench
--mem-type gpu`` between two network namespaces), NIXL's UCX gets those transports, as that backend does.
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
from _measure import block_layout, pin_target, summarize  # noqa: E402

GPUS = tuple(int(g) for g in os.environ["MORI_PEER_GPUS"].split(",")) if os.environ.get("MORI_PEER_GPUS") else None


def _peer_environment() -> None:
    """The peers' settings, made in the peer processes only (mori imports this module too)."""
    rdma_transports = os.environ.get("MORI_IO_RDMA_TRANSPORTS")
    if GPUS is None or rdma_transports:
        # Against mori's RDMA backend: the transports it is allowed (same UCX transports both sides).
        os.environ.setdefault("UCX_TLS", rdma_transports or "tcp,self")
    if GPUS is not None:
        os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")


MARK = "@@mori-bench "  # peers' libraries log to stdout too: our lines carry this mark


def _send(obj: Any) -> None:
    print(MARK + json.dumps(obj), flush=True)


def read_marked(stream: Any) -> Any:
    """The next marked JSON object on ``stream`` (other lines are the peer library's logging)."""
    for line in stream:
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return None


class _Buffer:
    """Host memory (numpy), or with ``MORI_PEER_GPUS`` GPU memory (torch) of the target's or the
    initiator's GPU; the target's GPU buffer holds :func:`_pattern`. Made before the peer's
    engine: importing torch loads the CUDA runtime that the peers' CUDA transports look for."""

    def __init__(self, size: int, role: str) -> None:
        self.device = None if GPUS is None else GPUS[0 if role == "target" else 1]
        self.data: Any
        if self.device is None:
            import numpy as np

            self.data = np.ones(size, dtype=np.uint8)
            self.addr = int(self.data.ctypes.data)
            return
        import torch

        torch.cuda.set_device(self.device)
        self.data = (
            _pattern(size, self.device)
            if role == "target"
            else torch.zeros(size, dtype=torch.uint8, device=f"cuda:{self.device}")
        )
        torch.cuda.synchronize()
        self.addr = int(self.data.data_ptr())

    def check_read(self, size: int, batch: int) -> bool:
        """Whether the blocks of a read point hold the target's bytes (GPU memory only)."""
        assert self.device is not None, "host buffers hold no pattern"
        n = size * batch
        got = self.data[:n].view(batch, size)
        expect = _pattern(n, self.device).view(batch, size)
        return bool((got == expect.flip(0)).all())  # block_layout reverses remote order


def _pattern(size: int, device: int) -> Any:
    import torch

    idx = torch.arange(size, dtype=torch.int64, device=f"cuda:{device}")
    return ((idx * 131 + 7) % 251).to(torch.uint8)


def _checked(buf: _Buffer, op: str, size: int, batch: int, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``checked``: whether a GPU read point's data matched the target's."""
    if buf.device is not None and op == "read":
        row["checked"] = buf.check_read(size, batch)
    return row


# ---- Mooncake ------------------------------------------------------------------------------------
def _mooncake_engine(host: str) -> Any:
    from mooncake.engine import TransferEngine

    eng = TransferEngine()
    protocol = "tcp" if GPUS is None else "nvlink_intra"
    if eng.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
        raise SystemExit(f"mooncake: initialize ({protocol}) failed")
    return eng


def _mooncake_location(buf: _Buffer) -> str:
    return "*" if buf.device is None else f"cuda:{buf.device}"


def mooncake_target(host: str, size: int) -> None:
    buf = _Buffer(size, "target")
    eng = _mooncake_engine(host)
    if eng.register_memory(buf.addr, size, _mooncake_location(buf)) != 0:
        raise SystemExit("mooncake: register_memory failed")
    _send({"addr": buf.addr, "name": f"{host}:{eng.get_rpc_port()}"})
    sys.stdin.read()


def mooncake_initiator(
    host: str, op: str, points: list[tuple[int, int]], iters: int, warmup: int, target: dict[str, Any]
) -> None:
    import numpy as np

    need = max(s * b for s, b in points)
    buf = _Buffer(need, "initiator")
    eng = _mooncake_engine(host)
    if eng.register_memory(buf.addr, need, _mooncake_location(buf)) != 0:
        raise SystemExit("mooncake: register_memory failed")
    name = "batch_transfer_sync_read" if op == "read" else "batch_transfer_sync_write"
    arrays = getattr(eng, name + "_arrays", None)  # newer Mooncake: offsets as arrays, its faster call
    fn = arrays or getattr(eng, name)
    for size, batch in points:
        l_offs, r_offs = block_layout(size, batch)
        local: Any = np.asarray(l_offs, dtype=np.uint64) + np.uint64(buf.addr)
        remote: Any = np.asarray(r_offs, dtype=np.uint64) + np.uint64(target["addr"])
        sizes: Any = np.full(batch, size, dtype=np.uint64)
        if arrays is None:
            local, remote, sizes = local.tolist(), remote.tolist(), sizes.tolist()
        times, cpu = [], 0.0
        for i in range(warmup + iters):
            # The CPU clock first: reading it takes a system call (about 0.6 us), not part of the transfer.
            c0 = time.process_time()
            t0 = time.perf_counter()
            if fn(target["name"], local, remote, sizes) != 0:
                raise SystemExit("mooncake: transfer failed")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
        _send(_checked(buf, op, size, batch, summarize(size, batch, times, cpu)))


# ---- NIXL ----------------------------------------------------------------------------------------
def _nixl_agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _nixl_mem(buf: _Buffer) -> tuple[str, int]:
    return ("DRAM", 0) if buf.device is None else ("VRAM", buf.device)


def nixl_target(host: str, size: int) -> None:
    buf = _Buffer(size, "target")
    agent = _nixl_agent("nixl-target")
    kind, dev = _nixl_mem(buf)
    reg = agent.register_memory([(buf.addr, size, dev, "")], kind)
    assert reg is not None
    _send({"addr": buf.addr, "dev": dev, "meta": agent.get_agent_metadata().hex()})
    sys.stdin.read()


def nixl_initiator(
    host: str, op: str, points: list[tuple[int, int]], iters: int, warmup: int, target: dict[str, Any]
) -> None:
    need = max(s * b for s, b in points)
    buf = _Buffer(need, "initiator")
    agent = _nixl_agent("nixl-initiator")
    peer = agent.add_remote_agent(bytes.fromhex(target["meta"]))
    kind, dev = _nixl_mem(buf)
    agent.register_memory([(buf.addr, need, dev, "")], kind)
    for size, batch in points:
        l_offs, r_offs = block_layout(size, batch)
        local = agent.get_xfer_descs([(buf.addr + o, size, dev) for o in l_offs], kind)
        remote = agent.get_xfer_descs([(target["addr"] + o, size, target["dev"]) for o in r_offs], kind)
        handle = agent.initialize_xfer("READ" if op == "read" else "WRITE", local, remote, peer)
        times, cpu = [], 0.0
        for i in range(warmup + iters):
            # The CPU clock first: reading it takes a system call (about 0.6 us), not part of the transfer.
            c0 = time.process_time()
            t0 = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise SystemExit("nixl: transfer failed")
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpu += time.process_time() - c0
        agent.release_xfer_handle(handle)
        _send(_checked(buf, op, size, batch, summarize(size, batch, times, cpu)))


ENGINES = {"mooncake": (mooncake_target, mooncake_initiator), "nixl": (nixl_target, nixl_initiator)}


def main() -> None:
    _peer_environment()
    engine, role, host = sys.argv[1], sys.argv[2], sys.argv[3]
    target_fn, initiator_fn = ENGINES[engine]
    if role == "target":
        pin_target()
        target_fn(host, int(sys.argv[4]))
        return
    op, iters, warmup = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    points = [tuple(p) for p in json.loads(sys.argv[7])]
    need = max(s * b for s, b in points)
    # MORI_PEER_TARGET_NETNS/HOST: the target runs in that network namespace on that address.
    netns = os.environ.get("MORI_PEER_TARGET_NETNS")
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen(
        [*prefix, sys.executable, __file__, engine, "target", os.environ.get("MORI_PEER_TARGET_HOST", host), str(need)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
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
