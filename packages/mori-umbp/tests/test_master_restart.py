"""A master killed (SIGKILL) and started again. On Redis it serves its index at once from what
Redis kept, and the peers' next heartbeats carry on from their sequence; in memory it starts
empty, tells the peers so, and rebuilds from their re-registration and full sync. Also: MORI's
key layout in Redis, namespaces, and a Redis that goes away."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest
import redis
from _master_harness import free_port, master_command, redis_server, running_master

from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._master_client import (
    EventBundle,
    MasterClient,
    MasterError,
    NodeStatus,
)

DRAM, SSD = 2, 3


def add(key: str, size: int, tier: int = DRAM) -> KvEvent:
    return KvEvent(KvEventType.ADD, key, tier, size)


def populate(address: str) -> MasterClient:
    a = MasterClient(address, "node-a", "a:1", peer_address="a:2", tags=["sgl_role=prefill"])
    a.register_client({DRAM: (1 << 30, 1 << 29), SSD: (1 << 34, 1 << 34)})
    a.heartbeat([EventBundle(1, [add(f"page-{i}", 4096 * (i + 1)) for i in range(8)])])
    a.heartbeat([EventBundle(2, [add("page-0", 4096, SSD), KvEvent(KvEventType.REMOVE, "page-7", DRAM, 0)])])
    a.report_external_kv_blocks("node-a", ["h0", "h1"], DRAM)
    return a


def test_master_restarted_on_redis_serves_its_index_from_redis(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}
        with running_master(env) as first:
            a = populate(first.address)
            first.kill()
            with pytest.raises(MasterError):
                a.route_get("page-1")

        with running_master(env) as second:
            reader = MasterClient(second.address, "reader")
            keys = [f"page-{i}" for i in range(8)]
            assert reader.batch_lookup(keys) == [True] * 7 + [False]
            loc = reader.route_get("page-3")
            assert (loc.node_id, loc.tier, loc.size, loc.peer_address) == ("node-a", DRAM, 4 * 4096, "a:2")
            assert [(m.node_id, m.hashes_by_tier) for m in reader.match_external_kv(["h0", "h1"])] == [
                ("node-a", {DRAM: ["h0", "h1"]})
            ]
            assert second.scrape()[("mori_umbp_master_index_keys", ())] == 7
            # The peer's next heartbeat continues its sequence: no re-registration, no full sync.
            a2 = MasterClient(second.address, "node-a")
            reply = a2.heartbeat([EventBundle(3, [add("page-8", 100)])])
            assert (reply.status, reply.acked_seq, reply.request_full_sync) == (NodeStatus.ALIVE, 3, False)
            assert reader.batch_lookup(["page-8"]) == [True]
            # And the registration still holds: a second live "node-a" is refused.
            with pytest.raises(MasterError, match="already alive"):
                MasterClient(second.address, "node-a").register_client({DRAM: (1, 1)})


def test_master_restarted_in_memory_rebuilds_from_the_next_heartbeats():
    with running_master() as first:
        a = populate(first.address)
        first.kill()
    with running_master() as second:
        a = MasterClient(second.address, "node-a", "a:1", peer_address="a:2")
        reader = MasterClient(second.address, "reader")
        assert reader.batch_lookup(["page-1"]) == [False]
        # The master does not know the node: it re-registers and ships everything it holds.
        assert a.heartbeat([EventBundle(3, [add("page-8", 100)])]).status == NodeStatus.UNKNOWN
        a.register_client({DRAM: (1 << 30, 1 << 29)})
        held = [add(f"page-{i}", 4096 * (i + 1)) for i in range(7)] + [add("page-8", 100)]
        reply = a.heartbeat([EventBundle(0, held)], full_sync=True, seq_baseline=3)
        assert (reply.status, reply.acked_seq) == (NodeStatus.ALIVE, 3)
        assert reader.batch_lookup([f"page-{i}" for i in range(9)]) == [True] * 7 + [False, True]
        assert reader.route_get("page-8").size == 100


def test_redis_holds_mori_s_key_layout_under_the_namespace(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri, "UMBP_REDIS_NAMESPACE": "blue"}
        with running_master(env) as master:
            populate(master.address)
            r = redis.Redis.from_url(uri.replace("tcp://", "redis://"), decode_responses=True)
            p = "{umbp:blue}"
            node = r.hgetall(f"{p}:node:node-a")
            assert (node["addr"], node["peer"], node["status"], node["seq"], node["tags"]) == (
                "a:1",
                "a:2",
                "1",
                "2",
                "sgl_role=prefill",
            )
            assert node["caps"] == f"2:{1 << 30}:{1 << 29}:0;3:{1 << 34}:{1 << 34}:0"
            assert r.smembers(f"{p}:nodes:alive") == {"node-a"}
            assert r.hgetall(f"{p}:alive_peers") == {"node-a": "a:2"}
            block = r.hgetall(f"{p}:block:page-0")
            assert (block["l|node-a|2"], block["l|node-a|3"], block["_n"]) == ("4096", "4096", "2")
            assert not r.exists(f"{p}:block:page-7")
            assert r.scard(f"{p}:node:node-a:blocks") == 7
            assert r.zrange(f"{p}:lru:node-a:3", 0, -1) == ["page-0"]
            assert r.hgetall(f"{p}:extkv:h0") == {"node-a": str(1 << DRAM)}
            assert r.smembers(f"{p}:extkv:node:node-a") == {"h0", "h1"}
            assert r.get(f"{p}:nblocks") == "7"
            # Another namespace on the same Redis is another index.
            other = {**env, "UMBP_REDIS_NAMESPACE": "green"}
            with running_master(other) as green:
                assert MasterClient(green.address).batch_lookup(["page-1"]) == [False]


def test_redis_going_away_fails_calls_cleanly_until_it_is_back(tmp_path):
    port = free_port()
    with redis_server(tmp_path, port) as uri:
        env = {
            "UMBP_METADATA_BACKEND": "redis",
            "UMBP_REDIS_URI": uri,
            "UMBP_REDIS_SOCKET_TIMEOUT_MS": "500",
            "UMBP_REDIS_CONNECT_TIMEOUT_MS": "500",
        }
        master_cm = running_master(env)
        master = master_cm.__enter__()
    try:
        # Redis is stopped now; the master answers, with UNAVAILABLE and the reason.
        c = MasterClient(master.address, "n", timeout_s=10)
        with pytest.raises(MasterError, match="metadata store unavailable") as e:
            c.route_get("k")
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(MasterError, match="metadata store unavailable"):
            c.register_client({DRAM: (1, 1)})
        assert master.proc.poll() is None
        scraped = master.scrape()
        assert (
            scraped[("mori_umbp_master_rejected_requests_total", (("code", "UNAVAILABLE"), ("rpc", "RouteGet")))] == 1
        )
        # A Redis back on the same address (empty: no persistence here) is used again.
        with redis_server(tmp_path, port):
            c.register_client({DRAM: (1, 1)})
            c.heartbeat([EventBundle(1, [add("k", 10)])])
            assert c.route_get("k").node_id == "n"
    finally:
        master_cm.__exit__(None, None, None)


def test_master_without_redis_uri_says_so(tmp_path):
    env = {"UMBP_METADATA_BACKEND": "redis", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*master_command(), "127.0.0.1:0", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "UMBP_METADATA_BACKEND=redis needs UMBP_REDIS_URI" in done.stderr


def test_a_lowered_quota_still_takes_removals(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}
        with running_master(env) as first:
            a = MasterClient(first.address, "node-a")
            a.register_client({DRAM: (1 << 30, 1 << 30)})
            a.heartbeat([EventBundle(1, [add(f"k{i}", 10) for i in range(100)])])
            first.kill()
        with running_master({**env, "UMBP_MASTER_MAX_KEYS_PER_CLIENT": "50"}) as second:
            a = MasterClient(second.address, "node-a")
            drop = [KvEvent(KvEventType.REMOVE, f"k{i}", DRAM, 0) for i in range(10)]
            assert a.heartbeat([EventBundle(2, drop)]).acked_seq == 2  # 90 keys, still over 50
            with pytest.raises(MasterError, match="would own 91 keys, over its quota of 50") as e:
                a.heartbeat([EventBundle(3, [add("new", 10)])])
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert second.scrape()[("mori_umbp_master_index_keys", ())] == 90


def test_two_masters_on_one_redis_share_one_index(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}
        with running_master(env) as one, running_master(env) as two:
            a = populate(one.address)
            via_two = MasterClient(two.address, "reader")
            assert via_two.route_get("page-2").size == 3 * 4096
            a_via_two = MasterClient(two.address, "node-a")
            assert a_via_two.heartbeat([EventBundle(3, [add("page-9", 9)])]).acked_seq == 3
            assert MasterClient(one.address).batch_lookup(["page-9"]) == [True]
            via_two.match_external_kv(["h0"], count_as_hit=True)
            assert [(e.hash, e.hit_count_total) for e in a.get_external_kv_hit_counts(["h0"])] == [("h0", 1)]


def test_a_wiped_redis_is_rebuilt_from_the_next_heartbeats(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}
        with running_master(env) as master:
            a = populate(master.address)
            redis.Redis.from_url(uri.replace("tcp://", "redis://")).flushall()  # a Redis restarted empty
            reader = MasterClient(master.address, "reader")
            assert reader.batch_lookup(["page-1"]) == [False]
            assert a.heartbeat().status == NodeStatus.UNKNOWN
            a.register_client({DRAM: (1 << 30, 1 << 29)})
            a.heartbeat([EventBundle(0, [add("page-1", 8192)])], full_sync=True, seq_baseline=2)
            assert reader.route_get("page-1").size == 8192
            assert master.scrape()[("mori_umbp_master_index_keys", ())] == 1


def test_master_does_not_start_without_its_redis(tmp_path):
    env = {
        "UMBP_METADATA_BACKEND": "redis",
        "UMBP_REDIS_URI": f"tcp://127.0.0.1:{free_port()}",
        "PATH": "/usr/bin:/bin",
    }
    done = subprocess.run([*master_command(), "127.0.0.1:0", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1
    assert "cannot start: Redis:" in done.stderr


def test_nodes_are_not_blamed_for_the_master_s_downtime(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {
            "UMBP_METADATA_BACKEND": "redis",
            "UMBP_REDIS_URI": uri,
            "UMBP_HEARTBEAT_TTL_SEC": "5",
            "UMBP_MAX_MISSED_HEARTBEATS": "1",
            "UMBP_REAPER_INTERVAL_SEC": "1",
        }
        with running_master(env) as first:
            populate(first.address)
            first.kill()
        time.sleep(6)  # the master is down for longer than a node's expiry (5 s)
        with running_master(env) as second:
            # The nodes' last heartbeats are older than the expiry, but the master was the silent one:
            # it routes to them until one expiry after its own start.
            assert MasterClient(second.address).route_get("page-1").node_id == "node-a"


def test_a_large_full_sync_outlasts_the_redis_command_timeout(tmp_path):
    with redis_server(tmp_path) as uri:
        env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri, "UMBP_REDIS_SOCKET_TIMEOUT_MS": "50"}
        with running_master(env) as master:
            a = MasterClient(master.address, "big", timeout_s=120)
            a.register_client({DRAM: (1 << 40, 1 << 40)})
            held = [add(f"{i:064x}", 4096) for i in range(30000)]  # one script far longer than 50 ms
            reply = a.heartbeat([EventBundle(0, held)], full_sync=True, seq_baseline=1)
            assert (reply.status, reply.acked_seq) == (NodeStatus.ALIVE, 1)
            assert sum(a.batch_lookup([e.key for e in held[:1000]])) == 1000
            assert master.scrape()[("mori_umbp_master_index_keys", ())] == 30000
