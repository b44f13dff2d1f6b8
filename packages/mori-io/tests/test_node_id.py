"""EngineDesc.node_id: MORI_NODE_ID, else mori.core.host's machine (the boot id), as MORI resolves it."""

from __future__ import annotations

import pytest

from mori.core.host import this_host
from mori.io import IOEngine, IOEngineConfig


def _node_id(key: str) -> str:
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0))
    try:
        return engine.get_engine_desc().node_id
    finally:
        engine.close()


def test_node_id_is_the_machine_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MORI_NODE_ID", raising=False)
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert _node_id("node-a") == this_host().machine == f.read().strip()
    monkeypatch.setenv("MORI_NODE_ID", "node-7")
    assert _node_id("node-b") == "node-7"
