"""Fixtures: a long-lived target engine process per module and an initiator engine here."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _peer import PeerProcess, SharedBuffer

from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, TcpBackendConfig

REGION = (64 << 20) + 4096


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
