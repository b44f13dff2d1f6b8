"""SGLang 0.5.23's ``UMBPStore`` replayed on three nodes, each an SGLang rank in a network namespace
of its own, with the master in a fourth: with the in-memory store and with a real Redis server.
Each rank's configuration comes from ``extra_config`` (``master_address``, ``node_id``,
``node_address``), its host KV pool is registered, it backs pages up with ``batch_set_v1`` (the
master spreads them over the three nodes; pages move between namespaces by mori-io over TCP),
the other ranks find them with ``batch_exists`` and read them with ``batch_get_v1``, every byte
checked; the KV-events subscriber reports and revokes external KV blocks; teardown. Then the
master restarts: with Redis the index is served again at once, with the in-memory store the next
heartbeats (a re-registration and full sync) rebuild it, and the pages are found and read again.

Source replayed: as ``test_replays_sglang.py``, plus ``UMBPStore.__init__``'s ``master_address``
branch, re-created in :mod:`_sglang_umbp`.
"""

from __future__ import annotations

import contextlib

import pytest
from _cluster_replay import POOL, master_host, sglang_rank
from _hosts import hosts
from _master_harness import wait_until

from mori.core.testing import CommandProcess, start_in_netns
from mori.umbp import UMBPDeploymentMode

PAGES = 24  # per rank: 3 ranks' pages (72) fit no single rank's DRAM below, so they spread


@pytest.mark.slow
@pytest.mark.parametrize("store", ["inmemory", "redis"])
def test_umbp_store_replay_three_nodes_and_a_master(tmp_path, store: str) -> None:
    with hosts(4) as spaces, contextlib.ExitStack() as stack:
        *nodes, master_ns = spaces
        master = CommandProcess(
            master_host,
            (master_ns.address, store == "redis", str(tmp_path)),
            name="master",
            timeout=120,
            start=start_in_netns(master_ns.name),
        )
        stack.callback(master.close)
        address = master.ready
        ranks = []
        for i, ns in enumerate(nodes):
            extra = {
                "master_address": address,
                "node_id": f"rank{i}",
                "node_address": ns.address,
                "dram_capacity_bytes": 2 << 20,
                "ssd_enabled": "false",
                "staging_buffer_size": 1 << 20,
            }
            rank = CommandProcess(sglang_rank, (extra,), name=f"rank{i}", timeout=120, start=start_in_netns(ns.name))
            stack.callback(rank.close)
            info = rank.ready
            assert info["node_id"] == f"rank{i}" and info["mode"] == UMBPDeploymentMode.Distributed
            assert len(info["registered"]) == 1  # the host KV pool, for zero copy
            assert info["dram_page_size"] == POOL["page_size"] * POOL["layers"] * POOL["heads"] * POOL["head_dim"] * 2
            ranks.append(rank)

        keys = {i: [f"{i:02d}{p:014x}" for p in range(PAGES)] for i in range(3)}
        for i, rank in enumerate(ranks):
            assert rank.call("put", 100 + i, keys[i]) == [True] * PAGES
        spread = [rank.call("keys_here") for rank in ranks]
        assert sum(spread) == 3 * PAGES * 2 and min(spread) > 0, spread  # K and V per page, on every node

        def everyone_reads_everything() -> None:
            for reader, rank in enumerate(ranks):
                for owner in range(3):
                    wait_until(
                        lambda r=rank, o=owner: r.call("exists", keys[o]) == PAGES,
                        20,
                        f"rank{reader} sees rank{owner}'s pages",
                    )
                    assert rank.call("get", 100 + owner, keys[owner]) == [True] * PAGES, (reader, owner)

        everyone_reads_everything()

        # KV events: rank0's GPU blocks, found by rank2 through the master, then revoked.
        assert ranks[0].call("stored", [1, 2, 3]) is True
        assert ranks[2].call("match", [1, 2, 9]) == ["rank0"]
        assert ranks[0].call("removed", [1, 2, 3]) is True
        assert ranks[0].call("stored", [4]) is True and ranks[0].call("cleared") == (True, True)
        assert ranks[2].call("match", [1, 4]) == []

        master.call("restart", timeout=120)
        everyone_reads_everything()

        for rank in ranks:
            assert rank.call("close") is True
