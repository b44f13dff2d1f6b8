"""A node's heartbeat against a real master: events shipped in numbered bundles, an outbox that
overflows turned into a full sync, and a master that forgot the node (restarted) answered with a
re-registration and a full sync."""

from __future__ import annotations

import numpy as np
from _cluster_nodes import FAST_MASTER, KiB, node_config, seeded_pages
from _master_harness import MasterProcess, running_master

from mori.umbp import UMBPClient, _heartbeat
from mori.umbp._master_client import MasterClient

PAGE = 4 * KiB


def _node(master: str) -> UMBPClient:
    cfg = node_config(master, "node-a", None)
    assert cfg.distributed is not None
    cfg.distributed.master_config.auto_heartbeat = False  # the test sends them
    return UMBPClient(cfg)


def _known(master: str, keys: list[str]) -> list[bool]:
    with MasterClient(master, "observer") as observer:
        return observer.batch_lookup(keys)


def test_events_reach_the_master_and_an_overflow_becomes_a_full_sync(monkeypatch) -> None:
    monkeypatch.setattr(_heartbeat, "MAX_OUTBOX", 8)
    with running_master(FAST_MASTER) as master:
        node = _node(master.address)
        try:
            src = seeded_pages(1, 20, PAGE)
            keys = [f"k{i}" for i in range(20)]
            assert all(
                node.batch_put_from_ptr(keys[:4], [int(src.ctypes.data) + i * PAGE for i in range(4)], [PAGE] * 4)
            )
            assert _known(master.address, keys[:4]) == [False] * 4  # not shipped yet
            assert node.flush() and _known(master.address, keys[:4]) == [True] * 4
            assert all(
                node.batch_put_from_ptr(keys[4:], [int(src.ctypes.data) + i * PAGE for i in range(4, 20)], [PAGE] * 16)
            )  # 16 events: over the outbox
            assert node.flush() and _known(master.address, keys) == [True] * 20
        finally:
            node.close()


def test_a_master_that_forgot_the_node_gets_it_back() -> None:
    with running_master(FAST_MASTER) as master:
        node = _node(master.address)
        again: MasterProcess | None = None
        try:
            src = seeded_pages(2, 4, PAGE)
            keys = [f"r{i}" for i in range(4)]
            assert all(node.batch_put_from_ptr(keys, [int(src.ctypes.data) + i * PAGE for i in range(4)], [PAGE] * 4))
            assert node.flush()
            master.kill()
            again = MasterProcess(FAST_MASTER, listen=master.address).start()  # in memory: it knows nothing
            assert _known(again.address, keys) == [False] * 4
            node.flush()  # answered UNKNOWN: registers again and sends a full sync
            assert _known(again.address, keys) == [True] * 4
            out = np.zeros(PAGE, np.uint8)
            assert node.get_into_ptr("r2", int(out.ctypes.data), PAGE) and np.array_equal(out, src[2])
        finally:
            node.close()
            if again is not None:
                again.kill()
