"""Bad input and greedy clients against a master in its own process: every malformed key, size,
tier or batch is refused with INVALID_ARGUMENT naming what was wrong, and changes nothing; one
client cannot grow the bounded indexes past its quota, and others keep their share."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import grpc
import pytest
from _master_harness import redis_server, running_master

from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._master._proto import umbp_pb2 as pb
from mori.umbp._master._proto import umbp_pb2_grpc as pb_grpc
from mori.umbp._master_client import EventBundle, MasterClient, MasterError

DRAM, SSD = 2, 3

LIMITS = {
    "UMBP_MASTER_MAX_KEY_BYTES": "64",
    "UMBP_MASTER_MAX_BLOCK_BYTES": "1048576",
    "UMBP_MASTER_MAX_BATCH": "200",
    "UMBP_MASTER_MAX_KEYS_PER_CLIENT": "100",
    "UMBP_MASTER_MAX_KEYS": "150",
    "UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT": "20",
    "UMBP_MASTER_MAX_CLIENTS": "3",
}


def add(key: str, size: int = 4096, tier: int = DRAM) -> KvEvent:
    return KvEvent(KvEventType.ADD, key, tier, size)


@pytest.fixture(scope="module", params=["inmemory", "redis"])
def master(request, tmp_path_factory):
    if request.param == "inmemory":
        with running_master(LIMITS) as m:
            yield m
        return
    with (
        redis_server(tmp_path_factory.mktemp("redis")) as uri,
        running_master({**LIMITS, "UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": uri}) as m,
    ):
        yield m


def snapshot(master, c: MasterClient, keys: list[str]) -> tuple:
    m = master.scrape()
    return c.batch_lookup(keys), m[("mori_umbp_master_index_keys", ())], m[("mori_umbp_client_count", ())]


@contextlib.contextmanager
def refused(code: grpc.StatusCode, match: str) -> Iterator[None]:
    with pytest.raises(MasterError, match=match) as info:
        yield
    assert info.value.code == code


def test_malformed_requests_are_refused_and_change_nothing(master):
    a = MasterClient(master.address, "bad-input-node", peer_address="p:1")
    a.register_client({DRAM: (1 << 30, 1 << 30)})
    a.heartbeat([EventBundle(1, [add("kept")])])
    probe = ["kept", "x", "y", "z"]
    before = snapshot(master, a, probe)
    inv = grpc.StatusCode.INVALID_ARGUMENT
    cases = [
        (lambda: a.route_put("", 10), "key must not be empty"),
        (lambda: a.route_put("k" * 65, 10), "key is 65 bytes, longer than UMBP_MASTER_MAX_KEY_BYTES=64"),
        (lambda: a.route_put("k", 0), r"block_size=0 is outside 1..UMBP_MASTER_MAX_BLOCK_BYTES=1048576"),
        (lambda: a.route_put("k", (1 << 20) + 1), "block_size=1048577 is outside"),
        (lambda: a.batch_route_put(["a", "b"], [1]), "keys and block_sizes must have the same length"),
        (lambda: a.batch_route_put(["a", ""], [1, 1]), r"keys\[1\] must not be empty"),
        (lambda: a.batch_lookup([f"k{i}" for i in range(201)]), "keys has 201 entries, more than the limit 200"),
        (lambda: a.route_get("é" * 33), "key is 66 bytes"),
        # A heartbeat with one bad event among good ones applies none of them.
        (lambda: a.heartbeat([EventBundle(2, [add("x"), add("y" * 65)])]), r"bundles\[0\].events\[1\].key is 65 bytes"),
        (lambda: a.heartbeat([EventBundle(2, [add("x"), add("z", 0)])]), r"events\[1\].size=0 is outside"),
        (lambda: a.heartbeat([EventBundle(2, [add("x", 10, tier=7)])]), r"events\[0\].tier=7 is not a tier"),
        (lambda: a.heartbeat([EventBundle(2, [add("x", 10, tier=0)])]), r"events\[0\].tier=0 is not a tier"),
        (
            lambda: a.heartbeat([EventBundle(2, [add("x")])], tier_capacities={DRAM: (10, 20)}),
            r"available 20 exceeds total 10",
        ),
        (
            lambda: a.heartbeat([EventBundle(2, [add(f"e{i}") for i in range(201)])]),
            r"carries more than 200 events \(UMBP_MASTER_MAX_BATCH",
        ),
        (lambda: MasterClient(master.address, "a|b").register_client({DRAM: (1, 1)}), "holds '|'"),
        (lambda: MasterClient(master.address, "n" * 65).register_client({DRAM: (1, 1)}), "node_id is 65 bytes"),
        (lambda: MasterClient(master.address, "x:blocks").register_client({DRAM: (1, 1)}), "ends in ':blocks'"),
        (
            lambda: a.report_external_kv_blocks("bad-input-node", ["h", "node:x"], DRAM),
            r"hashes\[1\] starts with 'node:'",
        ),
        (
            lambda: MasterClient(master.address, "n", peer_address="p" * 300).register_client({DRAM: (1, 1)}),
            "peer_address is longer than 256 bytes",
        ),
        (lambda: MasterClient(master.address, "n").register_client({9: (1, 1)}), r"tier_capacities.tier=9"),
        (lambda: a.report_external_kv_blocks("bad-input-node", ["h", "x" * 65], DRAM), r"hashes\[1\] is 65 bytes"),
        (lambda: a.report_external_kv_blocks("", ["h"], DRAM), "node_id must not be empty"),
        (lambda: a.revoke_external_kv_blocks("bad-input-node", ["h"], 0), "tier=0 is not a tier"),
    ]
    for call, message in cases:
        with refused(inv, message):
            call()
        assert snapshot(master, a, probe) == before, message
    # Kinds outside ADD/REMOVE (proto3 enums are open) are refused too.
    stub = pb_grpc.UMBPMasterStub(grpc.insecure_channel(master.address))
    bad_kind = pb.HeartbeatRequest(node_id="bad-input-node")
    bad_kind.bundles.add(seq=2).events.add(kind=5, key="x", tier=DRAM, size=1)
    with pytest.raises(grpc.RpcError) as e:
        stub.Heartbeat(bad_kind, timeout=10)
    assert e.value.code() == inv and "kind=5 is neither ADD nor REMOVE" in e.value.details()
    # The sequence did not move: the next bundle is still 2.
    assert a.heartbeat([EventBundle(2, [add("x")])]).acked_seq == 2
    assert a.batch_lookup(["kept", "x"]) == [True, True]
    a.unregister_self()


def test_malformed_packed_lookups_are_refused_and_change_nothing(master):
    a = MasterClient(master.address, "packed-node", peer_address="p:1")
    a.register_client({DRAM: (1 << 30, 1 << 30)})
    a.heartbeat([EventBundle(1, [add("kept"), add("é" * 32)])])
    stub = pb_grpc.UMBPMasterStub(grpc.insecure_channel(master.address))

    def lookup(packed: bytes) -> bytes:
        return bytes(
            stub.BatchLookupPacked(pb.BatchLookupPackedRequest(node_id="packed-node", keys=packed), timeout=10).found
        )

    # One byte per key, in order; no keys, no bytes; a non-ASCII key of 64 bytes is within the limit.
    assert lookup(b"x\0kept\0" + ("é" * 32).encode() + b"\0") == b"\0\1\1"
    assert lookup(b"") == b""
    before = snapshot(master, a, ["kept", "x"])
    cases = [
        (b"kept", "the last key is not followed by a NUL byte"),
        (b"kept\0\0", r"keys\[1\] must not be empty"),
        (b"\0", r"keys\[0\] must not be empty"),
        (b"kept\0" + b"k" * 65 + b"\0", r"keys\[1\] is 65 bytes, longer than UMBP_MASTER_MAX_KEY_BYTES=64"),
        (("é" * 33).encode() + b"\0", r"keys\[0\] is 66 bytes"),
        (b"kept\0\xff\xfe\0", "keys: not UTF-8 at byte 5"),
        (b"k\0" * 201, "keys has 201 entries, more than the limit 200"),
    ]
    for packed, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            lookup(packed)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, packed
        assert re.search(message, e.value.details()), (packed, e.value.details())
        assert snapshot(master, a, ["kept", "x"]) == before
    # The client sends keys holding NUL (which the packed form cannot carry) with BatchLookup.
    assert a.batch_lookup(["kept", "a\0b"]) == [True, False]
    a.unregister_self()


def test_one_greedy_client_cannot_grow_the_index_without_limit(master):
    greedy = MasterClient(master.address, "greedy")
    modest = MasterClient(master.address, "modest")
    greedy.register_client({DRAM: (1 << 30, 1 << 30)})
    modest.register_client({DRAM: (1 << 30, 1 << 30)})
    greedy.heartbeat([EventBundle(1, [add(f"g{i}") for i in range(100)])])
    # Two more keys are over greedy's own quota: the whole bundle is refused.
    with refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "would own 102 keys, over its quota of 100"):
        greedy.heartbeat([EventBundle(2, [add("g100"), add("g101")])])
    assert greedy.batch_lookup(["g99", "g100", "g101"]) == [True, False, False]
    # A full sync is held to the same quota.
    with refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "UMBP_MASTER_MAX_KEYS_PER_CLIENT"):
        greedy.heartbeat([EventBundle(0, [add(f"f{i}") for i in range(101)])], full_sync=True, seq_baseline=5)
    assert greedy.batch_lookup(["g0", "f0"]) == [True, False]
    # Replacing keys within the quota is fine, and so is a REMOVE.
    assert greedy.heartbeat([EventBundle(2, [KvEvent(KvEventType.REMOVE, "g0", DRAM, 0), add("g100")])]).acked_seq == 2
    # The other client still has room, up to the index's total limit (150 keys).
    modest.heartbeat([EventBundle(1, [add(f"m{i}") for i in range(50)])])
    with refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "would hold 151 keys, over its limit of 150"):
        modest.heartbeat([EventBundle(2, [add("m50")])])
    # The same key on a second tier of one node is still one key.
    assert modest.heartbeat([EventBundle(2, [add("m0", tier=SSD)])]).acked_seq == 2
    assert master.scrape()[("mori_umbp_master_index_keys", ())] == 150

    # External-KV hashes: 20 per client.
    greedy.report_external_kv_blocks("greedy", [f"h{i}" for i in range(20)], DRAM)
    greedy.report_external_kv_blocks("greedy", ["h0", "h1"], SSD)  # known hashes at a new tier
    with refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT"):
        greedy.report_external_kv_blocks("greedy", ["h19", "h20"], DRAM)
    assert [m.matched_hash_count() for m in greedy.match_external_kv(["h19", "h20"])] == [1]

    # Clients: 3 at most.
    third = MasterClient(master.address, "third")
    third.register_client({DRAM: (1, 1)})
    with refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "UMBP_MASTER_MAX_CLIENTS"):
        MasterClient(master.address, "fourth").register_client({DRAM: (1, 1)})
    # Leaving frees the quota for others.
    greedy.unregister_self()
    assert master.scrape()[("mori_umbp_master_index_keys", ())] == 50
    modest.heartbeat([EventBundle(3, [add("m50")])])
    MasterClient(master.address, "fourth").register_client({DRAM: (1, 1)})


def test_a_full_sync_may_list_the_node_s_whole_quota():
    with running_master({"UMBP_MASTER_MAX_BATCH": "50", "UMBP_MASTER_MAX_KEYS_PER_CLIENT": "100"}) as master:
        a = MasterClient(master.address, "big")
        a.register_client({DRAM: (1 << 30, 1 << 30)})
        with refused(grpc.StatusCode.INVALID_ARGUMENT, "carries more than 50 events"):
            a.heartbeat([EventBundle(1, [add(f"k{i}") for i in range(80)])])
        assert (
            a.heartbeat([EventBundle(0, [add(f"k{i}") for i in range(80)])], full_sync=True, seq_baseline=1).acked_seq
            == 1
        )
        assert a.batch_lookup(["k0", "k79"]) == [True, True]
        with refused(grpc.StatusCode.INVALID_ARGUMENT, "carries more than 100 events"):
            a.heartbeat([EventBundle(0, [add(f"k{i}") for i in range(101)])], full_sync=True, seq_baseline=2)
