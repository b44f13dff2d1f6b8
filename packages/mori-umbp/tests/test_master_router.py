"""The router's choices, on an in-memory store: fastest tier first, the most room (or random by
room, never a node without it), each node's largest admissible block, the affinities, exclusions,
and a silent node left out of routing before the reaper runs."""

from __future__ import annotations

import collections

from mori.umbp._master.memory_store import InMemoryStore
from mori.umbp._master.router import Router
from mori.umbp._master.store import ClientRecord, KvEvent, Limits, TierCapacity

HBM, DRAM, SSD = 1, 2, 3
NOW = 10_000_000
EXPIRY = 30_000


def cluster(caps: dict[str, dict[int, tuple[int, ...]]], **router_kw) -> Router:
    store = InMemoryStore(Limits(16, 1000, 1000, 10, 10))
    for node, tiers in caps.items():
        record = ClientRecord(node, "", f"{node}:peer", b"", [], {t: TierCapacity(*c) for t, c in tiers.items()})
        assert store.register_client(record, NOW, EXPIRY)
    return Router(store, expiry_ms=EXPIRY, lease_ms=2000, **router_kw)


def targets(router: Router, sizes: list[int], requester: str = "", exclude: set[str] | None = None) -> list:
    keys = [f"key-{i}" for i in range(len(sizes))]
    return [(r.node_id, r.tier) for r in router.route_put(keys, sizes, requester, NOW, exclude or set())]


def test_fastest_tier_then_most_room():
    r = cluster({"a": {DRAM: (100, 60), SSD: (1000, 1000)}, "b": {DRAM: (100, 80)}, "c": {HBM: (50, 10)}})
    assert targets(r, [10]) == [("c", HBM)]  # HBM is fastest, though c has the least room
    assert targets(r, [20]) == [("b", DRAM)]  # too big for c's HBM; b has the most DRAM room
    assert targets(r, [20, 20, 20]) == [("b", DRAM), ("a", DRAM), ("b", DRAM)]  # rooms shrink in a batch
    assert targets(r, [90]) == [("a", SSD)]
    assert targets(r, [2000]) == [("", 0)]
    assert targets(r, [20], exclude={"b"}) == [("a", DRAM)]


def test_max_allocatable_caps_one_block():
    r = cluster({"a": {DRAM: (1000, 900, 64)}, "b": {DRAM: (1000, 500)}})
    assert targets(r, [64, 65]) == [("a", DRAM), ("b", DRAM)]


def test_random_is_weighted_by_room_and_never_picks_a_node_without_it():
    r = cluster({"a": {DRAM: (1000, 900)}, "b": {DRAM: (1000, 100)}, "c": {DRAM: (1000, 5)}}, select_algo="random")
    picks = collections.Counter(targets(r, [10])[0][0] for _ in range(2000))
    assert picks["c"] == 0
    assert picks["a"] > 4 * picks["b"] > 0  # 9:1 by room


def test_affinities():
    caps = {"a": {DRAM: (1000, 900)}, "b": {DRAM: (1000, 300)}}
    local = cluster(caps, node_affinity="local")
    assert targets(local, [10, 10], requester="b") == [("b", DRAM), ("b", DRAM)]
    assert targets(local, [400], requester="b") == [("a", DRAM)]  # b cannot take it: the base choice
    same = cluster({"a": {DRAM: (1000, 150)}, "b": {DRAM: (1000, 120)}, "c": {DRAM: (1000, 100)}}, node_affinity="same")
    assert targets(same, [50, 50, 50]) == [("a", DRAM)] * 3  # one node fits the whole batch
    assert targets(same, [60, 60, 60]) == [("a", DRAM), ("a", DRAM), ("b", DRAM)]  # sticky until full


def test_gets_read_the_fastest_live_replica_and_existing_keys_are_not_routed_again():
    r = cluster({"a": {DRAM: (1000, 1000)}, "b": {SSD: (1000, 1000)}})
    r.store.apply_heartbeat("a", 1, 1, NOW, {}, [KvEvent(True, "k", DRAM, 7)], False)
    r.store.apply_heartbeat("b", 1, 1, NOW, {}, [KvEvent(True, "k", SSD, 7)], False)
    [route] = r.route_get(["k"], NOW, set())
    assert (route.location.node_id, route.location.tier, route.location.size, route.peer_address) == (
        "a",
        DRAM,
        7,
        "a:peer",
    )
    assert r.route_get(["k"], NOW, {"a"})[0].location.node_id == "b"
    assert r.route_put(["k"], [7], "", NOW, set())[0].already_exists
    # a goes silent past its expiry: b serves, before any reaper has run.
    later = NOW + EXPIRY + 1
    r.store.apply_heartbeat("b", 0, 0, later, {}, [], False)  # b's keepalive
    assert r.route_get(["k"], later, set())[0].location.node_id == "b"
    assert r.exists(["k"], later) == [True]
    r.store.apply_heartbeat("b", 2, 2, later, {}, [KvEvent(False, "k", SSD)], False)
    assert r.exists(["k"], later) == [False]  # only silent a holds it
    assert r.route_get(["k"], later, set()) == [None]
    [put] = r.route_put(["new"], [10], "", later, set())
    assert (put.node_id, put.tier) == ("b", SSD)
