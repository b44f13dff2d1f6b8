"""Nodes of a cluster with a master (its own process): puts routed by the master, pages moved
between nodes by mori-io (TCP) and read back byte for byte, the external-KV index, and a peer
killed mid-run: its gets fail cleanly, never with other bytes, and its blocks leave the index."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _cluster_nodes import FAST_MASTER, KiB, node_config, row_ptrs, seeded_pages
from _master_harness import running_master, wait_until

from mori.umbp import UMBPClient, UMBPTierType

PAGE = 16 * KiB
HERE = Path(__file__).resolve().parent


@pytest.fixture()
def master():
    with running_master(FAST_MASTER) as m:
        yield m


@pytest.mark.parametrize("backend", ["tcp", "rdma"])
def test_two_nodes_put_on_one_get_on_the_other(master, tmp_path, monkeypatch, backend: str) -> None:
    """Over mori-io's TCP backend, and its RDMA backend (UCX; here over UCX's tcp transport, as
    mori-io's tests run it without an RDMA NIC)."""
    monkeypatch.setenv("UMBP_IO_BACKEND", backend)
    monkeypatch.setenv("MORI_IO_RDMA_TRANSPORTS", "tcp")
    a = UMBPClient(node_config(master.address, "node-a", tmp_path / "a"))
    b = UMBPClient(node_config(master.address, "node-b", tmp_path / "b"))
    try:
        src, dst = seeded_pages(1, 64, PAGE), np.zeros((64, PAGE), np.uint8)
        keys = [f"p{i}" for i in range(64)]
        assert a.register_memory(int(src.ctypes.data), src.nbytes)
        assert b.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert all(a.batch_put_from_ptr(keys, row_ptrs(src), [PAGE] * 64))
        assert a.flush() and b.flush()
        spread = a.stats()["keys"], b.stats()["keys"]
        assert sum(spread) == 64 and min(spread) > 0, spread  # the master spread them over both
        wait_until(lambda: b.batch_exists_consecutive(keys) == 64, 10, "every key visible from b")
        assert all(b.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 64))
        assert np.array_equal(src, dst)
        # a page at an address no registered buffer covers goes through the staging buffer
        loose = np.zeros((1, PAGE), np.uint8)
        remote = next(k for k in keys if not b._store.contains(k))
        assert b.get_into_ptr(remote, int(loose.ctypes.data), PAGE)
        assert np.array_equal(loose[0], src[keys.index(remote)])
        assert not b.get_into_ptr("absent", int(loose.ctypes.data), PAGE)
        assert not b.get_into_ptr(remote, int(loose.ctypes.data), PAGE // 2)  # another size: a miss
        # a put of a stored key anywhere in the cluster is a success that changes nothing
        assert b.put_from_ptr(remote, int(dst.ctypes.data), PAGE)
    finally:
        b.close()
        a.close()


def test_external_kv_report_match_revoke(master, tmp_path) -> None:
    a = UMBPClient(node_config(master.address, "node-a", None))
    b = UMBPClient(node_config(master.address, "node-b", None))
    try:
        assert a.report_external_kv_blocks(["h1", "h2"], UMBPTierType.HBM)
        assert b.report_external_kv_blocks(["h2"], UMBPTierType.DRAM)
        matches = {m.node_id: m for m in b.match_external_kv(["h1", "h2", "h3"], count_as_hit=True)}
        assert set(matches) == {"node-a", "node-b"}
        assert matches["node-a"].hashes_by_tier == {UMBPTierType.HBM: ["h1", "h2"]}
        assert matches["node-a"].matched_hash_count() == 2 and matches["node-a"].peer_address
        counts = {e.hash: e.hit_count_total for e in a.get_external_kv_hit_counts(["h1", "h2", "h3"])}
        assert counts.get("h1", 0) >= 1
        assert a.revoke_external_kv_blocks(["h1"], UMBPTierType.HBM)
        assert b.revoke_all_external_kv_blocks_at_tier(UMBPTierType.DRAM)
        matches = {m.node_id: m for m in b.match_external_kv(["h1", "h2"])}
        assert set(matches) == {"node-a"} and matches["node-a"].hashes_by_tier == {UMBPTierType.HBM: ["h2"]}
    finally:
        b.close()
        a.close()


def test_a_peer_killed_fails_its_gets_and_leaves_the_index(master, tmp_path) -> None:
    spec = {
        "master": master.address,
        "node_id": "owner",
        "ssd_dir": str(tmp_path / "owner"),
        "seed": 7,
        "count": 32,
        "size": PAGE,
        "prefix": "owned",
    }
    owner = subprocess.Popen(
        [sys.executable, str(HERE / "_cluster_nodes.py"), json.dumps(spec)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    reader = None
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip() == "ready", line + owner.stdout.read() if owner.poll() is not None else line
        reader = UMBPClient(node_config(master.address, "reader", None))
        expected = seeded_pages(7, 32, PAGE)
        keys = [f"owned-{i}" for i in range(32)]
        dst = np.zeros((32, PAGE), np.uint8)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert reader.batch_exists_consecutive(keys) == 32
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 32))
        assert np.array_equal(dst, expected)
        # Gets in a loop while the owner is killed mid-way: a page is either read whole and right
        # or reported missing, never reported read with other bytes.
        wrong: list[int] = []
        misses = threading.Event()

        def read_until_it_fails() -> None:
            while not misses.is_set():
                dst[:] = 0
                got = reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 32)
                wrong.extend(i for i, ok in enumerate(got) if ok and not np.array_equal(dst[i], expected[i]))
                if not all(got):
                    misses.set()

        thread = threading.Thread(target=read_until_it_fails)
        thread.start()
        time.sleep(0.3)
        owner.kill()
        owner.wait(10)
        thread.join(60)
        assert not thread.is_alive() and misses.is_set() and wrong == []
        dst[:] = 0
        started = time.monotonic()
        assert reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 32) == [False] * 32
        assert time.monotonic() - started < 30  # each call has its deadline
        assert not dst.any()
        wait_until(lambda: reader.batch_exists(keys) == [False] * 32, 20, "the dead owner's blocks leave the index")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if reader is not None:
            reader.close()


def test_pages_on_the_owners_ssd_are_staged_back_for_a_remote_reader(master, tmp_path) -> None:
    owner = UMBPClient(node_config(master.address, "owner", tmp_path / "owner", dram=256 * KiB))
    reader = None
    try:
        src = seeded_pages(3, 48, PAGE)  # 768 KiB for 256 KiB of DRAM: most pages go to SSD
        keys = [f"s{i}" for i in range(48)]
        owner.register_memory(int(src.ctypes.data), src.nbytes)
        assert all(owner.batch_put_from_ptr(keys, row_ptrs(src), [PAGE] * 48))  # the only node: all here
        assert owner.flush()
        assert owner.stats()["ssd_keys"] >= 32
        reader = UMBPClient(node_config(master.address, "reader", None))
        dst = np.zeros((48, PAGE), np.uint8)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 48))
        assert np.array_equal(src, dst)
        assert reader.stats()["keys"] == 0  # read through, not cached
    finally:
        if reader is not None:
            reader.close()
        owner.close()


def test_a_node_that_comes_back_under_its_id_is_met_again(master, tmp_path) -> None:
    a = UMBPClient(node_config(master.address, "node-a", None, dram=1 << 20))
    b = UMBPClient(node_config(master.address, "node-b", None, dram=16 << 20))
    try:
        first, second = seeded_pages(11, 8, PAGE), seeded_pages(12, 8, PAGE)
        out = np.zeros((8, PAGE), np.uint8)
        for buf in (first, second, out):
            a.register_memory(int(buf.ctypes.data), buf.nbytes)
        keys = [f"x{i}" for i in range(8)]
        assert all(a.batch_put_from_ptr(keys, row_ptrs(first), [PAGE] * 8))  # b has the room: they go to b
        assert all(a.batch_get_into_ptr(keys, row_ptrs(out), [PAGE] * 8)) and np.array_equal(out, first)
        assert b.stats()["keys"] == 8
        b.close()
        b = UMBPClient(node_config(master.address, "node-b", None, dram=16 << 20))  # a new engine, a new port
        keys = [f"y{i}" for i in range(8)]
        assert all(a.batch_put_from_ptr(keys, row_ptrs(second), [PAGE] * 8))
        assert b.stats()["keys"] == 8
        out[:] = 0
        assert all(a.batch_get_into_ptr(keys, row_ptrs(out), [PAGE] * 8)) and np.array_equal(out, second)
        assert a.batch_exists([f"x{i}" for i in range(8)]) == [False] * 8  # left with the old b
    finally:
        b.close()
        a.close()


def test_without_its_master_a_node_keeps_its_own_pages(master, tmp_path) -> None:
    a = UMBPClient(node_config(master.address, "node-a", None))
    b = UMBPClient(node_config(master.address, "node-b", None))
    try:
        src, dst = seeded_pages(13, 4, PAGE), np.zeros((4, PAGE), np.uint8)
        master.kill()
        keys = [f"m{i}" for i in range(4)]
        started = time.monotonic()
        assert all(a.batch_put_from_ptr(keys, row_ptrs(src), [PAGE] * 4))  # no route: stored here
        assert all(a.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 4)) and np.array_equal(src, dst)
        assert a.batch_exists(keys) == [True] * 4
        assert b.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 4) == [False] * 4  # nobody to ask where
        assert b.batch_exists(keys) == [False] * 4 and not b.flush()
        assert time.monotonic() - started < 60
    finally:
        b.close()
        a.close()


def test_pages_read_from_a_peer_are_kept_when_admitted(master, tmp_path) -> None:
    owner = UMBPClient(node_config(master.address, "owner", None, dram=16 << 20))
    reader = None
    try:
        src = seeded_pages(14, 8, PAGE)
        keys = [f"c{i}" for i in range(8)]
        owner.register_memory(int(src.ctypes.data), src.nbytes)
        assert all(owner.batch_put_from_ptr(keys, row_ptrs(src), [PAGE] * 8)) and owner.flush()
        cfg = node_config(master.address, "reader", None, dram=1 << 20, cache_remote_fetches=True)
        assert cfg.distributed is not None
        cfg.distributed.admission_max_block_bytes = PAGE  # 16 KiB pages are admitted; the big one is not
        reader = UMBPClient(cfg)
        dst = np.zeros((8, PAGE), np.uint8)
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 8)) and np.array_equal(src, dst)
        assert reader.stats()["keys"] == 8  # kept: the next reads are local
        owner.clear()
        dst[:] = 0
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 8)) and np.array_equal(src, dst)
        big = seeded_pages(15, 1, 2 * PAGE)
        assert owner.put_from_ptr("big", int(big.ctypes.data), 2 * PAGE) and owner.flush()
        out = np.zeros(2 * PAGE, np.uint8)
        assert reader.get_into_ptr("big", int(out.ctypes.data), 2 * PAGE) and np.array_equal(out, big[0])
        assert not reader._store.contains("big")  # over the admission size: read through
    finally:
        if reader is not None:
            reader.close()
        owner.close()
