"""Fixtures: a long-lived target engine process per module and an initiator engine here; for the
client replays (test_client_replays*.py), the backend they run on and their initiator engine; for
the hostile-load tests (test_hostile*.py), targets under lowered limits; for the examples that
listen on MORI's fixed ports, a lock that makes them take turns."""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from _hostile import REGION as HOSTILE_REGION
from _hostile import Target
from _kv_clients import make_engine
from _peer import PeerProcess, SharedBuffer

from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType, TcpBackendConfig

REGION = (64 << 20) + 4096
#: Held by a test while its engines listen on ports 8080 and 8081, as MORI's example and the seed's do.
FIXED_PORTS_LOCK = os.path.join(tempfile.gettempdir(), "mori-io-tests-ports-8080-8081.lock")


@pytest.fixture()
def fixed_ports() -> Iterator[None]:
    """Waits for, then holds, a machine-wide lock on ports 8080/8081: the test runs in parallel
    (pytest-xdist workers, and ci/newest.sh's run beside the main one), and two examples on the
    same fixed ports at once would fail to listen."""
    with open(FIXED_PORTS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="module")
def initiator() -> Iterator[IOEngine]:
    engine = IOEngine("initiator", IOEngineConfig(host="127.0.0.1", port=0))
    # Three connections: batches and large blocks are striped (the default may be one).
    engine.create_backend(BackendType.TCP, TcpBackendConfig(num_connections=3))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def target(initiator: IOEngine) -> Iterator[PeerProcess]:
    peer = PeerProcess("target")
    try:
        peer.call("register_engine", initiator.get_engine_desc().pack())
        initiator.register_remote_engine(peer.desc)
        yield peer
    finally:
        peer.close()


@pytest.fixture(scope="module")
def remote_region(target: PeerProcess) -> Iterator[tuple[SharedBuffer, MemoryDesc]]:
    buf = SharedBuffer(REGION)
    try:
        desc = MemoryDesc.unpack(target.call("register_shm", buf.path, buf.size))
        yield buf, desc
    finally:
        buf.unlink()


@pytest.fixture(params=["rdma", "tcp"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The clients' own backend (RDMA, on UCX's tcp transport: no NIC here) or the TCP backend.
    The child processes inherit the environment."""
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    return str(request.param)


@pytest.fixture()
def engine(backend: str) -> Iterator[IOEngine]:
    """The replays' transferring engine, built as the clients build theirs (``make_engine``)."""
    eng = make_engine("initiator-0", backend)
    yield eng
    eng.close()


@pytest.fixture()
def make_target() -> Iterator[Callable[..., Target]]:
    """Makes hostile-load targets (``_hostile.Target``) under the given env; closes them after."""
    made: list[Target] = []

    def make(env: dict[str, str] | None = None) -> Target:
        made.append(Target(env))
        return made[-1]

    yield make
    for t in made:
        t.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Target, IOEngine, np.ndarray, MemoryDesc]]:
    """One hostile-load target per module and an engine here with a region to send from."""
    target = Target()
    engine = IOEngine("hostile-init", IOEngineConfig())
    engine.create_backend(BackendType.TCP)
    engine.register_remote_engine(target.desc)
    src = np.arange(HOSTILE_REGION, dtype=np.uint64).view(np.uint8)[:HOSTILE_REGION].copy()
    ld = engine.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
    yield target, engine, src, ld
    engine.close()
    target.close()
