"""Two network namespaces joined by a veth pair: two "hosts" with their own addresses on this
machine (a real network path through the kernel, not loopback), and engine processes in them
(:class:`NetnsPeer`, a ``PipeProcess``: a mori.core.testing worker started through ``ip netns exec``).

Needs root and iproute2, which CI has (ci/setup.sh installs iproute2; CI runs as root). Without
them the tests fail loudly rather than skipping, so a CI change that loses them is noticed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from _peer import PipeProcess, SharedBuffer, engine_commands, serve_commands

from mori.core import testing
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

__all__ = ["HERE", "HOST_A", "HOST_B", "NetnsPeer", "two_namespaces"]

HERE = Path(__file__).resolve().parent
HOST_A, HOST_B = "10.231.7.1", "10.231.7.2"
BLOCK = 65536


@contextlib.contextmanager
def two_namespaces() -> Iterator[tuple[str, str]]:
    """Namespaces A (``HOST_A``) and B (``HOST_B``) joined by a veth pair (mori.core.testing's,
    TCP between them as between real hosts); removed after."""
    with testing.network_namespaces(HOST_A.rpartition(".")[0]) as (a, b):
        yield a.name, b.name


def _outcome(st: TransferStatus) -> tuple[str, str]:
    """(code name, or HUNG when unfinished after 60 s; message) of a transfer."""
    finished = st.WaitFor(60_000) != StatusCode.IN_PROGRESS
    return (st.Code().name if finished else "HUNG"), st.Message()


def _serve(role: str, host: str, shm: str, size: int, backends: Sequence[str], rdma_workers: int) -> bytes:
    """An engine named ``role`` on ``host`` with ``backends`` (RDMA with ``rdma_workers`` UCX
    workers) and the shared file ``shm`` registered."""
    engine = IOEngine(role, IOEngineConfig(host=host, port=0))
    for name in backends:
        if name == "rdma":
            engine.create_backend(BackendType.RDMA, RdmaBackendConfig(num_worker_threads=rdma_workers))
        else:
            engine.create_backend(BackendType.TCP)
    buf = SharedBuffer(size, shm)
    mem = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
    half, quarter = size // 2, size // 4

    def transfer(op: str, remote: bytes, uid: int | None = None) -> tuple[str, str]:
        """64 KiB blocks: a write sends [0, half) there, a read brings its [0, half) into [half, size)."""
        offs = list(range(0, half, BLOCK))
        fn = engine.batch_write if op == "write" else engine.batch_read
        l_offs = offs if op == "write" else [o + half for o in offs]
        uid = engine.allocate_transfer_uid() if uid is None else uid
        return _outcome(fn(mem, l_offs, MemoryDesc.unpack(remote), offs, [BLOCK] * len(offs), uid))

    def session(remote: bytes) -> tuple[str, str]:
        """Through a session: writes [0, quarter) to [quarter, half) there, reads that back into [3 quarter, size)."""
        sess = engine.create_session(mem, MemoryDesc.unpack(remote))
        if sess is None:
            return "NO_SESSION", ""
        outcome = _outcome(sess.write(0, quarter, quarter, sess.allocate_transfer_uid()))
        if outcome[0] != "SUCCESS":
            return outcome
        return _outcome(sess.read(3 * quarter, quarter, quarter, sess.allocate_transfer_uid()))

    def spread() -> int:
        """Transfers the RDMA backend's UCX engine spread over its workers (private: this package's test)."""
        return int(engine._backends._by_type[BackendType.RDMA]._engine.stats()["spread"])

    return serve_commands(
        engine,
        {**engine_commands(engine, {}), "mem": mem.pack, "transfer": transfer, "session": session, "spread": spread},
        buf,
    )


class NetnsPeer(PipeProcess):
    """An engine named ``role`` in namespace ``ns`` at ``host`` with ``backends``, ``buf``
    registered (``mem``: its packed descriptor); ``env`` is added to its environment;
    ``rdma_workers`` is the RDMA backend's ``num_worker_threads``."""

    def __init__(
        self,
        ns: str,
        role: str,
        host: str,
        buf: SharedBuffer,
        backends: Sequence[str] = ("tcp",),
        env: dict[str, str] | None = None,
        rdma_workers: int = -1,
    ) -> None:
        super().__init__(_serve, (role, host, buf.path, buf.size, tuple(backends), rdma_workers), role, 90.0, ns, env)
        self.mem: bytes = self.call("mem")

    def connect(self, other: NetnsPeer) -> None:
        """Each of the two engines registers the other."""
        self.call("register_engine", other.desc.pack())
        other.call("register_engine", self.desc.pack())
