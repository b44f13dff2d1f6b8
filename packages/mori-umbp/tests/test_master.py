"""The UMBP master in its own process (``mori-umbp-master``), driven by real gRPC clients:
registration, heartbeats carrying KvEvents, routing, lookup, the external-KV index, TTL expiry
of a silent peer, eviction advice to a peer's EvictKey service, and the metrics it serves."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from _master_harness import MasterProcess, free_port, master_command, redis_server, running_master, wait_until

from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._master._proto import umbp_pb2 as pb
from mori.umbp._master._proto import umbp_pb2_grpc as pb_grpc
from mori.umbp._master._proto import umbp_peer_pb2 as peer_pb
from mori.umbp._master._proto import umbp_peer_pb2_grpc as peer_grpc
from mori.umbp._master_client import (
    EventBundle,
    MasterClient,
    MasterError,
    MasterUnavailableError,
    NodeStatus,
    RoutePutOutcome,
)

HBM, DRAM, SSD = 1, 2, 3
GiB = 1 << 30


def add(key: str, size: int, tier: int = DRAM) -> KvEvent:
    return KvEvent(KvEventType.ADD, key, tier, size)


def remove(key: str, tier: int = DRAM) -> KvEvent:
    return KvEvent(KvEventType.REMOVE, key, tier, 0)


@pytest.fixture(params=["inmemory", "redis"])
def store_env(request, tmp_path):
    """The master's environment for each metadata store; Redis is a fresh server per test."""
    if request.param == "inmemory":
        yield {}
        return
    with redis_server(tmp_path) as uri:
        yield {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}


@pytest.fixture
def master(store_env):
    with running_master(store_env) as m:
        yield m


def client(master: MasterProcess, node: str, **kw) -> MasterClient:
    return MasterClient(master.address, node, f"{node}.host:1", peer_address=f"{node}.host:2", **kw)


def test_register_heartbeat_route_and_lookup(master):
    a, b = client(master, "node-a"), client(master, "node-b")
    assert a.register_client({DRAM: (4 * GiB, 3 * GiB)}) == 5000  # ttl 10 s / divisor 2
    b.register_client({DRAM: (4 * GiB, 1 * GiB), SSD: (64 * GiB, 64 * GiB)})
    with pytest.raises(MasterError, match="already alive") as e:
        client(master, "node-a").register_client({DRAM: (1, 1)})
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS

    # Puts go to the node with the most room on the fastest tier that fits.
    route = b.route_put("page-0", 1 << 20)
    assert (route.outcome, route.node_id, route.tier, route.peer_address) == (
        RoutePutOutcome.ROUTED,
        "node-a",
        DRAM,
        "node-a.host:2",
    )
    # A block bigger than any DRAM room falls through to SSD.
    assert b.route_put("big", 5 * GiB).node_id == "node-b" and b.route_put("big", 5 * GiB).tier == SSD
    assert b.route_put("huge", 128 * GiB).outcome == RoutePutOutcome.UNAVAILABLE
    # Within one batch the projected room shrinks: 3 x 1 GiB spread a, a, then a or b.
    routes = b.batch_route_put(["x0", "x1", "x2"], [GiB, GiB, GiB])
    assert [r.node_id for r in routes[:2]] == ["node-a", "node-a"]
    assert routes[2].node_id in ("node-a", "node-b")

    # Committing: a heartbeat carrying ADD events puts the blocks into the index.
    reply = a.heartbeat(
        [EventBundle(1, [add(f"page-{i}", 4096 + i) for i in range(4)])],
        tier_capacities={DRAM: (4 * GiB, 3 * GiB - 4 * 4096)},
    )
    assert (reply.status, reply.acked_seq, reply.request_full_sync) == (NodeStatus.ALIVE, 1, False)
    assert a.batch_lookup(["page-0", "page-3", "page-4"]) == [True, True, False]
    assert b.route_put("page-0", 4096).outcome == RoutePutOutcome.ALREADY_EXISTS

    loc = b.route_get("page-2")
    assert (loc.node_id, loc.tier, loc.size, loc.peer_address) == ("node-a", DRAM, 4098, "node-a.host:2")
    assert b.route_get("page-2", exclude_nodes=["node-a"]) is None
    assert b.route_get("nope") is None
    got = b.batch_route_get(["page-1", "nope", "page-3"])
    assert got[1] is None
    assert [(g.node_id, g.size) for g in (got[0], got[2])] == [("node-a", 4097), ("node-a", 4099)]

    # The same key on two nodes and two tiers: a get reads the fastest tier.
    b.heartbeat([EventBundle(1, [add("page-1", 4097, SSD)])])
    assert b.route_get("page-1").node_id == "node-a"
    a.heartbeat([EventBundle(2, [remove("page-1")])])
    assert (b.route_get("page-1").node_id, b.route_get("page-1").tier) == ("node-b", SSD)

    # Removing: a REMOVE event takes the block out; unregistering takes all of a node's blocks.
    a.heartbeat([EventBundle(3, [remove("page-0")])])
    assert a.batch_lookup(["page-0", "page-2"]) == [False, True]
    a.unregister_self()
    assert not a.is_registered()
    assert b.batch_lookup(["page-1", "page-2", "page-3"]) == [True, False, False]


def test_heartbeat_sequence_full_sync_and_unknown_node(master):
    a = client(master, "node-a")
    a.register_client({DRAM: (GiB, GiB)})
    assert a.heartbeat().status == NodeStatus.ALIVE  # a keepalive carries no bundle
    a.heartbeat([EventBundle(1, [add("k1", 10)]), EventBundle(2, [add("k2", 20)])])
    # A gap (seq 4 after 2) applies nothing and asks for a full sync.
    reply = a.heartbeat([EventBundle(4, [add("k4", 40)])])
    assert (reply.acked_seq, reply.request_full_sync) == (2, True)
    assert a.batch_lookup(["k1", "k2", "k4"]) == [True, True, False]
    # A full sync replaces the node's blocks wholesale and re-baselines the sequence.
    reply = a.heartbeat([EventBundle(0, [add("k2", 20), add("k3", 30)])], full_sync=True, seq_baseline=10)
    assert (reply.status, reply.acked_seq) == (NodeStatus.ALIVE, 10)
    assert a.batch_lookup(["k1", "k2", "k3"]) == [False, True, True]
    assert a.heartbeat([EventBundle(11, [remove("k2")])]).acked_seq == 11
    assert a.batch_lookup(["k2", "k3"]) == [False, True]
    # Bundles sent again (the reply was lost) are skipped, not replayed and not taken for a gap.
    resent = [EventBundle(12, [add("k5", 50)]), EventBundle(13, [remove("k5")])]
    assert a.heartbeat(resent).acked_seq == 13
    reply = a.heartbeat([*resent, EventBundle(14, [add("k6", 60)])])
    assert (reply.acked_seq, reply.request_full_sync) == (14, False)
    assert a.batch_lookup(["k5", "k6"]) == [False, True]
    reply = a.heartbeat(resent)
    assert (reply.acked_seq, reply.request_full_sync) == (14, False)
    # Bundles of one request must be consecutive.
    with pytest.raises(MasterError, match=r"bundles\[1\].seq=17 does not follow"):
        a.heartbeat([EventBundle(15, []), EventBundle(17, [])])
    # A node the master does not know is told so.
    assert client(master, "ghost").heartbeat().status == NodeStatus.UNKNOWN


def test_external_kv_report_revoke_match_and_hits(master):
    a, b = client(master, "node-a"), client(master, "node-b")
    a.register_self({DRAM: (GiB, GiB)})
    b.register_self({HBM: (GiB, GiB)})
    hashes = ["h0", "h1", "h2"]
    a.report_external_kv_blocks("node-a", hashes, DRAM)
    a.report_external_kv_blocks("node-a", hashes[:2], HBM)
    b.report_external_kv_blocks("node-b", ["h1"], HBM)
    a.report_external_kv_blocks("stranger", ["h9"], DRAM)  # not registered: ignored
    a.report_external_kv_blocks("stranger-2", ["h9"], DRAM)
    rejected = (
        "mori_umbp_external_kv_report_total",
        (("node", "(unregistered)"), ("result", "rejected_not_alive"), ("tier", "dram")),
    )
    assert master.scrape()[rejected] == 2  # one series for every unknown node id

    query = MasterClient(master.address)
    matches = {m.node_id: m for m in query.match_external_kv(["h0", "h1", "h2", "h9"])}
    assert set(matches) == {"node-a", "node-b"}
    assert matches["node-a"].hashes_by_tier == {HBM: ["h0", "h1"], DRAM: ["h0", "h1", "h2"]}
    assert matches["node-a"].matched_hash_count() == 3
    assert (matches["node-b"].peer_address, matches["node-b"].hashes_by_tier) == ("node-b.host:2", {HBM: ["h1"]})
    assert query.match_external_kv([]) == []

    a.revoke_external_kv_blocks("node-a", ["h0"], HBM)
    a.revoke_all_external_kv_blocks_at_tier("node-a", DRAM)
    matches = {m.node_id: m.hashes_by_tier for m in query.match_external_kv(hashes)}
    assert matches == {"node-a": {HBM: ["h1"]}, "node-b": {HBM: ["h1"]}}

    # Hit counters: once per unique matched hash per counted call, never for unmatched ones.
    query.match_external_kv(["h1", "h1", "h2"], count_as_hit=True)
    query.match_external_kv(["h1"], count_as_hit=True)
    query.match_external_kv(["h1"])  # not counted
    counts = {e.hash: e.hit_count_total for e in query.get_external_kv_hit_counts(["h1", "h2", "h9"])}
    assert counts == {"h1": 2}
    with pytest.raises(MasterError, match="UMBP_HIT_QUERY_MAX_BATCH=4096") as e:
        query.get_external_kv_hit_counts([f"x{i}" for i in range(4097)])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT

    b.revoke_all_external_kv_blocks_for_node("node-b")
    assert [m.node_id for m in query.match_external_kv(["h1"])] == ["node-a"]
    a.unregister_self()  # a node's hashes leave with it; its hit counters stay
    assert query.match_external_kv(["h1"]) == []
    assert [(e.hash, e.hit_count_total) for e in query.get_external_kv_hit_counts(["h1"])] == [("h1", 2)]
    with pytest.raises(MasterError, match="hashes must not be empty"):
        a.report_external_kv_blocks("node-a", [], DRAM)


# Expiry 2 s x 2; the live node beats every 0.2 s, twenty times within it even on a loaded machine.
TTL_ENV = {"UMBP_HEARTBEAT_TTL_SEC": "2", "UMBP_MAX_MISSED_HEARTBEATS": "2", "UMBP_REAPER_INTERVAL_SEC": "1"}


def keep_alive(c: MasterClient, stop: threading.Event) -> threading.Thread:
    def beat() -> None:
        while not stop.wait(0.2):
            with contextlib.suppress(MasterError):  # one slow call must not end the beating
                c.heartbeat()

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    return t


def test_silent_peer_leaves_the_index_within_its_ttl(store_env):
    with running_master({**store_env, **TTL_ENV}) as master:
        silent, live = client(master, "silent"), client(master, "live")
        silent.register_client({DRAM: (GiB, GiB)})
        live.register_client({DRAM: (GiB, GiB)})
        stop = threading.Event()
        beater = keep_alive(live, stop)
        try:
            silent.heartbeat([EventBundle(1, [add("s-key", 100)])])
            live.heartbeat([EventBundle(1, [add("l-key", 100)])])
            assert live.route_get("s-key").node_id == "silent"
            # The silent node stops being routed to once its expiry passes...
            wait_until(lambda: live.route_get("s-key") is None, 30, "s-key unrouted")
            assert live.batch_lookup(["s-key", "l-key"]) == [False, True]
            assert live.route_put("new", 10).node_id == "live"
            # ...and the reaper takes it out of the registry and the index.
            wait_until(lambda: master.scrape()[("mori_umbp_master_expired_clients_total", ())] == 1, 30, "reaped")
            assert master.scrape()[("mori_umbp_master_index_keys", ())] == 1
            assert silent.heartbeat().status == NodeStatus.UNKNOWN
            assert live.route_get("l-key").node_id == "live"
        finally:
            stop.set()
            beater.join(timeout=10)


class RecordingPeer(peer_grpc.UMBPPeerServicer):
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def EvictKey(self, request, context):
        self.calls.append(list(request.keys))
        return peer_pb.EvictKeyResponse(evicted=[peer_pb.EvictKeyEntry(key=k, bytes_freed=100) for k in request.keys])


def test_eviction_advice_goes_to_the_peer_over_its_high_watermark(store_env):
    peer = RecordingPeer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    peer_grpc.add_UMBPPeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        env = {**store_env, "UMBP_EVICTION_CHECK_INTERVAL_SEC": "1", "UMBP_LEASE_DURATION_SEC": "60"}
        with running_master(env) as master:
            full = MasterClient(master.address, "full", peer_address=f"127.0.0.1:{port}")
            full.register_client({DRAM: (1000, 1000)})
            # 950 of 1000 bytes used: over 0.9, so free down to 0.7 (250 bytes = 3 blocks of 100).
            full.heartbeat(
                [EventBundle(1, [add(f"k{i}", 100) for i in range(9)] + [add("tiny", 50)])],
                tier_capacities={DRAM: (1000, 50)},
            )
            full.route_get("k0")  # k0 is read now: leased and most recently used, so not a victim
            wait_until(lambda: peer.calls, 30, "an EvictKey call")
            assert peer.calls[0] == ["k1", "k2", "k3"]
            # Counted once the peer has answered: the peer saw the call a moment before.
            advised = ("mori_umbp_master_evict_advised_keys_total", (("node", "full"), ("tier", "dram")))
            wait_until(lambda: master.scrape().get(advised, 0) >= 3, 30, "the advised keys counted")
            assert master.scrape()[advised] >= 3
            # The index changes only when the peer's REMOVE events arrive.
            assert full.batch_lookup(["k1", "k2", "k3"]) == [True, True, True]
            full.heartbeat(
                [EventBundle(2, [remove("k1"), remove("k2"), remove("k3")])], tier_capacities={DRAM: (1000, 350)}
            )
            assert full.batch_lookup(["k1", "k2", "k3", "k4"]) == [False, False, False, True]
    finally:
        server.stop(None).wait(10)


def test_metrics_are_served_with_mori_names(master):
    a, b = client(master, "node-a"), client(master, "node-b")
    a.register_client({DRAM: (1000, 600)})
    b.register_client({SSD: (5000, 5000)})
    a.heartbeat(
        [EventBundle(1, [add("k1", 100), add("k2", 100)])],
        tier_capacities={DRAM: (1000, 400)},
        tier_kv_counts={DRAM: 2},
    )
    b.route_put("k3", 10)
    b.batch_route_put(["k4", "k5"], [10, 10])
    b.route_get("k1")
    b.batch_route_get(["k1", "k2", "zz"])
    a.report_external_kv_blocks("node-a", ["h1", "h2"], DRAM)
    b.match_external_kv(["h1", "h3"])
    with pytest.raises(MasterError):
        b.route_put("", 10)
    m = master.scrape()
    dram_a = (("node", "node-a"), ("tier", "dram"))
    assert m[("mori_umbp_client_count", ())] == 2
    assert m[("mori_umbp_client_capacity_total_bytes", dram_a)] == 1000
    assert m[("mori_umbp_client_capacity_available_bytes", dram_a)] == 400
    assert m[("mori_umbp_client_capacity_used_bytes", dram_a)] == 600
    assert m[("mori_umbp_client_capacity_utilization_ratio", dram_a)] == pytest.approx(0.6)
    assert m[("mori_umbp_client_kv_live_count", dram_a)] == 2
    assert m[("mori_umbp_client_kv_live_count_total", (("node", "node-a"),))] == 2
    assert m[("mori_umbp_heartbeat_events_applied_total", (("node", "node-a"),))] == 2
    assert m[("mori_umbp_client_route_put_total", (("node", "node-a"),))] == 1
    assert m[("mori_umbp_client_batch_route_put_total", (("node", "node-a"),))] == 2
    assert m[("mori_umbp_client_route_get_total", (("node", "node-a"),))] == 1
    assert m[("mori_umbp_client_batch_route_get_total", (("node", "node-a"),))] == 2
    assert m[("mori_umbp_external_kv_report_total", (("node", "node-a"), ("result", "ok"), ("tier", "dram")))] == 1
    assert m[("mori_umbp_external_kv_report_blocks_total", dram_a)] == 2
    assert m[("mori_umbp_external_kv_live_count", (("node", "node-a"),))] == 2
    assert m[("mori_umbp_external_kv_match_total", ())] == 1
    assert m[("mori_umbp_external_kv_match_queried_blocks_total", ())] == 2
    assert m[("mori_umbp_external_kv_match_matched_blocks_total", ())] == 1
    assert m[("mori_umbp_master_index_keys", ())] == 2
    assert m[("mori_umbp_master_rejected_requests_total", (("code", "INVALID_ARGUMENT"), ("rpc", "RoutePut")))] == 1
    assert m[("mori_umbp_master_rpc_latency_seconds_count", (("rpc", "Heartbeat"),))] == 1
    # A node that leaves takes its series with it: the series stay bounded by the clients.
    a.unregister_self()
    m = master.scrape()
    assert not [k for k in m if ("node", "node-a") in k[1]]
    assert (m[("mori_umbp_client_count", ())], m[("mori_umbp_master_index_keys", ())]) == (1, 0)


def test_unreachable_master_fails_fast_with_a_clear_error():
    port = free_port()
    c = MasterClient(f"127.0.0.1:{port}", "n", timeout_s=1.0)
    with pytest.raises(MasterUnavailableError, match=f"UMBP master at 127.0.0.1:{port} is unreachable") as e:
        c.route_get("k")
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        MasterClient("127.0.0.1:1", timeout_s=0)


class _MoriSMasterLookupOnly(pb_grpc.UMBPMasterServicer):
    """A master as MORI's is to this client: BatchLookup, and no BatchLookupPacked (the base
    class answers UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def BatchLookup(self, request, context):
        self.calls.append(list(request.keys))
        return pb.BatchLookupResponse(found=[k.startswith("held") for k in request.keys])


def test_client_asks_a_master_without_the_packed_lookup_with_batch_lookup():
    servicer = _MoriSMasterLookupOnly()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_UMBPMasterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with MasterClient(f"127.0.0.1:{port}", "n") as c:
            assert c.batch_lookup(["held-1", "other", "held-2"]) == [True, False, True]
            assert c.batch_lookup(["other", "held-3"]) == [False, True]  # straight to BatchLookup now
            assert c.batch_lookup([]) == []  # no call
        assert servicer.calls == [["held-1", "other", "held-2"], ["other", "held-3"]]
    finally:
        server.stop(None)


def test_a_master_answering_the_wrong_count_is_an_error():
    class Short(pb_grpc.UMBPMasterServicer):
        def BatchLookupPacked(self, request, context):
            return pb.BatchLookupPackedResponse(found=b"\1")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_UMBPMasterServicer_to_server(Short(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with (
            MasterClient(f"127.0.0.1:{port}", "n") as c,
            pytest.raises(MasterError, match="asked about 2 keys, it answered 1") as e,
        ):
            c.batch_lookup(["a", "b"])
        assert e.value.code == grpc.StatusCode.INTERNAL
    finally:
        server.stop(None)


def test_master_stops_on_sigterm_and_reports_a_busy_port():
    master = MasterProcess().start()
    host, port = master.address.rsplit(":", 1)
    busy = subprocess.run([*master_command(), f"127.0.0.1:{port}", "0"], capture_output=True, text=True, timeout=60)
    assert busy.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in busy.stdout + busy.stderr
    assert master.stop() == 0
    usage = subprocess.run([*master_command(), "127.0.0.1:0", "99999"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "METRICS_PORT 99999 is not a port number" in usage.stderr
    # The name MORI's launchers run (UMBP_MASTER_BIN) is the same program.
    mori_name = Path(master_command()[0]).with_name("umbp_master")
    shown = subprocess.run([str(mori_name), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "usage: mori-umbp-master [-h] [address] [metrics_port]" in shown.stdout


def test_client_reported_metrics_are_merged_and_bounded(store_env):
    with running_master({**store_env, "UMBP_MASTER_MAX_REPORTED_SERIES": "3"}) as master:
        a = MasterClient(master.address, "node-a", tags=["sgl_role=prefill", "bad tag=x"])
        a.register_client({DRAM: (1, 1)})
        stub = pb_grpc.UMBPMasterStub(grpc.insecure_channel(master.address))

        def report(*samples: pb.MetricSample, node: str = "node-a") -> None:
            stub.ReportMetrics(pb.ReportMetricsRequest(node_id=node, metrics=samples), timeout=10)

        hist = pb.HistogramAggregate(bounds=[0.001, 0.01], bucket_counts=[1, 3], count=4, sum=0.5)
        label = [pb.MetricLabel(name="rpc", value="RoutePut")]
        for _ in range(2):
            report(
                pb.MetricSample(name="mori_umbp_client_outbound_put_bytes_total", help="h", counter_delta=100),
                pb.MetricSample(name="mori_umbp_x_gauge", gauge_value=7.5),
                pb.MetricSample(
                    name="mori_umbp_master_client_rpc_latency_seconds", labels=label, histogram_aggregate=hist
                ),
            )
        m = master.scrape()
        base = (("node", "node-a"), ("sgl_role", "prefill"))
        assert m[("mori_umbp_client_outbound_put_bytes_total", base)] == 200
        assert m[("mori_umbp_x_gauge", base)] == 7.5
        lat = tuple(sorted(base + (("rpc", "RoutePut"),)))
        assert m[("mori_umbp_master_client_rpc_latency_seconds_bucket", tuple(sorted(lat + (("le", "0.01"),))))] == 6
        assert m[("mori_umbp_master_client_rpc_latency_seconds_bucket", tuple(sorted(lat + (("le", "+Inf"),))))] == 8
        assert m[("mori_umbp_master_client_rpc_latency_seconds_sum", lat)] == 1.0

        def refused(code: grpc.StatusCode, match: str, *samples: pb.MetricSample, node: str = "node-a") -> None:
            with pytest.raises(grpc.RpcError) as e:
                report(*samples, node=node)
            assert e.value.code() == code and match in e.value.details(), e.value.details()

        inv = grpc.StatusCode.INVALID_ARGUMENT
        refused(inv, "must match", pb.MetricSample(name="other_metric", gauge_value=1))
        refused(inv, "the master's own metric", pb.MetricSample(name="mori_umbp_client_count", gauge_value=1))
        refused(
            inv,
            "counter delta must be finite and >= 0",
            pb.MetricSample(name="mori_umbp_client_outbound_put_bytes_total", counter_delta=-1),
        )
        refused(
            inv,
            "reported as a gauge, but 'mori_umbp_client_outbound_put_bytes' is a counter",
            pb.MetricSample(name="mori_umbp_client_outbound_put_bytes_total", gauge_value=1),
        )
        refused(
            inv,
            "bounds differ",
            pb.MetricSample(
                name="mori_umbp_master_client_rpc_latency_seconds",
                labels=label,
                histogram_aggregate=pb.HistogramAggregate(bounds=[1.0, 2.0], bucket_counts=[0, 0], count=0),
            ),
        )
        refused(
            inv,
            "'node' is the master's",
            pb.MetricSample(
                name="mori_umbp_x_gauge", labels=[pb.MetricLabel(name="node", value="other")], gauge_value=1
            ),
        )
        refused(inv, "carries no value", pb.MetricSample(name="mori_umbp_x_gauge"))
        refused(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "UMBP_MASTER_MAX_REPORTED_SERIES",
            pb.MetricSample(name="mori_umbp_x_gauge", gauge_value=1),  # known series, then a 4th
            pb.MetricSample(name="mori_umbp_y_gauge", gauge_value=1),
        )
        refused(
            grpc.StatusCode.NOT_FOUND,
            "is not registered",
            pb.MetricSample(name="mori_umbp_x_gauge", gauge_value=1),
            node="stranger",
        )
        assert master.scrape()[("mori_umbp_x_gauge", base)] == 7.5  # the refused reports changed nothing
        a.unregister_self()
        assert not [k for k in master.scrape() if ("node", "node-a") in k[1]]


def test_hit_counters_expire_after_their_ttl(store_env):
    env = {**store_env, "UMBP_HIT_INDEX_TTL_SEC": "3", "UMBP_HIT_INDEX_GC_INTERVAL_SEC": "1"}
    with running_master(env) as master:
        a = client(master, "node-a")
        a.register_client({DRAM: (GiB, GiB)})
        a.report_external_kv_blocks("node-a", ["hot", "cold"], DRAM)
        a.match_external_kv(["hot", "cold"], count_as_hit=True)
        assert {e.hash for e in a.get_external_kv_hit_counts(["hot", "cold"])} == {"hot", "cold"}
        stop = threading.Event()

        def keep_hot() -> None:
            while not stop.wait(0.2):
                a.match_external_kv(["hot"], count_as_hit=True)

        t = threading.Thread(target=keep_hot, daemon=True)
        t.start()
        try:
            wait_until(
                lambda: {e.hash for e in a.get_external_kv_hit_counts(["hot", "cold"])} == {"hot"},
                30,
                "the cold counter dropped",
            )
        finally:
            stop.set()
            t.join(timeout=10)
        # The placement index is untouched by the hit GC.
        assert a.match_external_kv(["cold"])[0].hashes_by_tier == {DRAM: ["cold"]}


def test_eviction_advice_to_an_unreachable_peer_is_counted_and_delays_no_other(store_env):
    peer = RecordingPeer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    peer_grpc.add_UMBPPeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # A deadline far longer than a round: a dead peer's call must not hold the live one's back.
    env = {**store_env, "UMBP_EVICTION_CHECK_INTERVAL_SEC": "1", "UMBP_EVICTKEY_DEADLINE_MS": "60000"}
    try:
        with running_master(env) as master:
            dead = MasterClient(master.address, "dead", peer_address=f"10.255.255.1:{free_port()}")
            live = MasterClient(master.address, "live", peer_address=f"127.0.0.1:{port}")
            for c in (dead, live):
                c.register_client({DRAM: (1000, 1000)})
                c.heartbeat(
                    [EventBundle(1, [add(f"{c.node_id}-{i}", 100) for i in range(10)])],
                    tier_capacities={DRAM: (1000, 0)},
                )
            wait_until(lambda: len(peer.calls) >= 2, 30, "two rounds of advice to the live peer")
            assert peer.calls[0] == ["live-0", "live-1", "live-2"]
            assert dead.batch_lookup([f"dead-{i}" for i in range(10)]) == [True] * 10
    finally:
        server.stop(None).wait(10)
    with running_master(
        {**store_env, "UMBP_EVICTION_CHECK_INTERVAL_SEC": "1", "UMBP_EVICTKEY_DEADLINE_MS": "200"}
    ) as m:
        refused = MasterClient(m.address, "refused", peer_address=f"127.0.0.1:{free_port()}")
        refused.register_client({DRAM: (1000, 1000)})
        refused.heartbeat([EventBundle(1, [add("r0", 100)])], tier_capacities={DRAM: (1000, 0)})
        failures = ("mori_umbp_master_evict_dispatch_failures_total", (("node", "refused"),))
        wait_until(lambda: m.scrape().get(failures, 0) >= 2, 30, "two failed EvictKey rounds")
        assert ("mori_umbp_master_evict_advised_keys_total", (("node", "refused"), ("tier", "dram"))) not in m.scrape()


def test_many_clients_at_once_leave_a_consistent_index(store_env):
    with running_master(store_env) as master:
        errors: list[BaseException] = []

        def node_life(n: int) -> None:
            try:
                c = MasterClient(master.address, f"node-{n}", peer_address=f"p{n}:1")
                c.register_client({DRAM: (GiB, GiB)})
                for seq in range(1, 11):
                    events = [add(f"n{n}-s{seq}-{i}", 100) for i in range(8)]
                    if seq > 1:
                        events.append(remove(f"n{n}-s{seq - 1}-0"))
                    assert c.heartbeat([EventBundle(seq, events)]).acked_seq == seq
                    c.batch_route_get([f"n{(n + 1) % 6}-s{seq}-{i}" for i in range(8)])
                    c.batch_route_put([f"new-{n}-{seq}"], [10])
            except BaseException as e:  # reported below, with the thread's node
                errors.append(e)

        threads = [threading.Thread(target=node_life, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads), errors
        reader = MasterClient(master.address)
        for n in range(6):
            held = reader.batch_lookup([f"n{n}-s{seq}-{i}" for seq in range(1, 11) for i in range(8)])
            # Every key of every bundle is there but the first of bundles 1-9, removed by the next.
            assert held == [not (i == 0 and seq < 10) for seq in range(1, 11) for i in range(8)]
        assert master.scrape()[("mori_umbp_master_index_keys", ())] == 6 * (80 - 9)


class HangingPeer(peer_grpc.UMBPPeerServicer):
    def __init__(self) -> None:
        self.called = threading.Event()
        self.release = threading.Event()

    def EvictKey(self, request, context):
        self.called.set()
        self.release.wait(120)
        return peer_pb.EvictKeyResponse()


def test_a_stop_does_not_wait_out_a_hanging_peer():
    peer = HangingPeer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    peer_grpc.add_UMBPPeerServicer_to_server(peer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    # EvictKey's deadline (120 s) is longer than MasterProcess.stop waits (30 s) for the exit.
    master = MasterProcess({"UMBP_EVICTION_CHECK_INTERVAL_SEC": "1", "UMBP_EVICTKEY_DEADLINE_MS": "120000"}).start()
    try:
        c = MasterClient(master.address, "n", peer_address=f"127.0.0.1:{port}")
        c.register_client({DRAM: (1000, 1000)})
        c.heartbeat([EventBundle(1, [add(f"k{i}", 100) for i in range(10)])], tier_capacities={DRAM: (1000, 0)})
        assert peer.called.wait(30)
        assert master.stop() == 0  # the call in flight was cancelled, not waited for
    finally:
        master.kill()
        peer.release.set()
        server.stop(None).wait(10)
