"""Engine processes for the RDMA backend's hostile tests between two network namespaces
(test_rdma_hostile_netns.py), and which UCX they load.

A *target* registers the window ``[lo, hi)`` of a shared file (the test maps the whole file, so a
byte written outside the window shows); an *initiator* registers its whole shared file and starts
transfers that it finishes later (so the test can kill a peer while they run), or fuzzes
descriptors in one call. Every engine has the RDMA backend alone: nothing else can carry bytes.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
from _netns import NetnsPeer
from _peer import PipeProcess, SharedBuffer, engine_commands, serve_commands

from mori.core import ucx
from mori.io import (
    BackendType,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    RdmaBackendConfig,
    StatusCode,
)
from mori.io.types import TransferStatus

__all__ = ["UCX_LIBS", "RdmaInitiator", "RdmaTarget", "Started", "ucx_lib"]

UCX_LIBS = ("wheel", "debian")  # the libucx wheel's UCX (no verbs), Debian's libucx0 (verbs)
_SOURCES = {"wheel": "libucx wheel", "debian": "system UCX with verbs"}


class Started:
    """What a namespace test started: engine processes and shared buffers of random bytes, all
    closed and unlinked by :meth:`close` at teardown."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.bufs: list[SharedBuffer] = []

    def random_buffer(self, size: int, seed: int) -> SharedBuffer:
        buf = SharedBuffer(size)
        buf.array[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        self.bufs.append(buf)
        return buf

    def close(self) -> None:
        for p in self.procs:
            p.close()
        for b in self.bufs:
            b.unlink()


def ucx_lib(name: str) -> str:
    """The ``libucp`` path of UCX ``name`` (for ``MORI_UCX_LIB``); fails when it is not installed
    (ci/setup.sh installs both)."""
    found = {source: path for path, source in ucx.candidates()}
    assert _SOURCES[name] in found, f"{name} UCX is not installed (candidates: {ucx.candidates()})"
    return found[_SOURCES[name]]


def _engine(role: str, host: str, workers: int) -> IOEngine:
    engine = IOEngine(role, IOEngineConfig(host=host, port=0))
    engine.create_backend(BackendType.RDMA, RdmaBackendConfig(num_worker_threads=workers))
    return engine


def _serve_target(role: str, host: str, shm: str, size: int, lo: int, hi: int, workers: int) -> bytes:
    engine = _engine(role, host, workers)
    buf = SharedBuffer(size, shm)
    mem = engine.register_memory(buf.addr + lo, hi - lo, -1, MemoryLocationType.CPU)
    return serve_commands(engine, {**engine_commands(engine, {mem.id: mem}), "mem": mem.pack}, buf)


def _finish(st: TransferStatus) -> tuple[str, str]:
    finished = st.WaitFor(60_000) != StatusCode.IN_PROGRESS
    return (st.Code().name if finished else "HUNG"), st.Message()


def _forged(rng: random.Random, desc: MemoryDesc) -> Any:
    """``desc`` with one field forged (ids, addresses, sizes, extra data), or a packed blob damaged."""
    pick = rng.randrange(7)
    edge = rng.choice([0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64 - 1, rng.getrandbits(64)])
    fields = desc.__dict__.copy()
    if pick == 0:
        fields["id"] = edge
    elif pick == 1:
        fields["size"] = max(desc.size, edge)
    elif pick == 2:
        fields["data"] = edge
    elif pick == 3:
        fields["extra"] = {"rdma": {"rkey": rng.randbytes(rng.randrange(0, 4096))}}
    elif pick == 4:
        fields["extra"] = {"rdma": rng.choice([{}, {"rkey": "x"}, {"ticket": edge}, {"rkey": [1, 2]}])}
    elif pick == 5:
        packed = bytearray(desc.pack())
        for _ in range(rng.randrange(1, 8)):
            packed[rng.randrange(len(packed))] = rng.randrange(256)
        return bytes(packed)
    else:
        fields["size"] = max(desc.size, edge)
        fields["id"] = rng.choice([desc.id, edge])
    return MemoryDesc(**fields)


def _serve_initiator(role: str, host: str, shm: str, size: int, workers: int) -> bytes:
    engine = _engine(role, host, workers)
    buf = SharedBuffer(size, shm)
    mem = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
    started: dict[int, TransferStatus] = {}

    def start(op: str, remote: bytes, local_off: int, remote_off: int, block: int, blocks: int) -> int:
        """Starts a batch of ``blocks`` contiguous blocks; returns its uid (``finish`` waits for it)."""
        uid = engine.allocate_transfer_uid()
        fn = engine.batch_write if op == "write" else engine.batch_read
        offs = [i * block for i in range(blocks)]
        started[uid] = fn(
            mem,
            [local_off + o for o in offs],
            MemoryDesc.unpack(remote),
            [remote_off + o for o in offs],
            [block] * blocks,
            uid,
        )
        return uid

    def finish(uid: int) -> tuple[str, str]:
        return _finish(started.pop(uid))

    def raw(op: str, remote: Any, local_off: int, remote_off: int, n: int) -> tuple[str, str]:
        """One transfer with a descriptor as given (a MemoryDesc, even a forged one; or packed)."""
        fn = engine.write if op == "write" else engine.read
        remote = MemoryDesc.unpack(remote) if isinstance(remote, bytes) else remote
        return _finish(fn(mem, local_off, remote, remote_off, n, engine.allocate_transfer_uid()))

    def fuzz(seed: int, cases: int, remote: bytes) -> dict[str, int]:
        """``cases`` transfers with forged descriptors and offsets; counts of outcomes by code."""
        rng, desc, out = random.Random(seed), MemoryDesc.unpack(remote), {}
        for _ in range(cases):
            forged = _forged(rng, desc)
            if isinstance(forged, bytes):
                try:
                    forged = MemoryDesc.unpack(forged)
                except ValueError:
                    out["unpack refused"] = out.get("unpack refused", 0) + 1
                    continue
            off = rng.choice([0, desc.size - 1, desc.size, desc.size + 4096, 2**40, rng.getrandbits(63)])
            n = rng.choice([1, 4096, 1 << 20, 2**32])
            try:
                code, _ = raw(rng.choice(["read", "write"]), forged, 0, off, min(n, size))
            except (ValueError, TypeError, KeyError) as err:  # refused in the call: an error, not a crash
                code = f"raised {type(err).__name__}"
            out[code] = out.get(code, 0) + 1
        return out

    def same_host(key: str) -> tuple[bool, str]:
        """Whether the RDMA backend reaches engine ``key`` on the UCX engine's same-host path (and
        why not, when refused): read from the backend's peer (a test's look inside)."""
        peer = engine._backends[BackendType.RDMA]._peers[key]  # type: ignore[attr-defined]
        return peer.same_host, peer.same_host_refusal

    commands = {
        **engine_commands(engine, {}),
        "start": start,
        "finish": finish,
        "raw": raw,
        "fuzz": fuzz,
        "same_host": same_host,
    }
    return serve_commands(engine, commands, buf)


class RdmaTarget(PipeProcess):
    """A target engine in namespace ``ns`` with the window ``[lo, hi)`` of ``buf`` registered
    (``mem``: its packed descriptor); ``workers``: its RDMA backend's num_worker_threads."""

    def __init__(
        self, ns: str, role: str, host: str, buf: SharedBuffer, lo: int, hi: int, env: dict[str, str], workers: int = -1
    ) -> None:
        super().__init__(_serve_target, (role, host, buf.path, buf.size, lo, hi, workers), role, 90.0, ns, env)
        self.mem: bytes = self.call("mem")


class RdmaInitiator(PipeProcess):
    """An initiator engine in namespace ``ns`` with all of ``buf`` registered; ``workers``: its
    RDMA backend's num_worker_threads."""

    def __init__(
        self, ns: str, role: str, host: str, buf: SharedBuffer, env: dict[str, str], workers: int = -1
    ) -> None:
        super().__init__(_serve_initiator, (role, host, buf.path, buf.size, workers), role, 90.0, ns, env)

    def meet(self, other: PipeProcess | NetnsPeer) -> None:
        """Each of the two engines registers the other."""
        self.call("register_engine", other.desc.pack())
        other.call("register_engine", self.desc.pack())
