"""The peer service on its own, over gRPC: what a peer or the master sends is checked, slots not
committed in time are reaped, pending slots are bounded, read leases and their release, and the
master's eviction advice."""

from __future__ import annotations

import ctypes
import re
import time

import grpc
import numpy as np
import pytest
from _pool import KiB, small_config

from mori.umbp import _grpc, _peer
from mori.umbp._master._proto import umbp_peer_pb2 as pb
from mori.umbp._master._proto import umbp_peer_pb2_grpc as pb_grpc
from mori.umbp._store import LocalStore

PAGE = 16 * KiB
OK, EXISTS, NO_SPACE = (
    pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALLOCATED,
    pb.ALLOCATE_SLOT_OUTCOME_SUCCESS_ALREADY_EXISTS,
    pb.ALLOCATE_SLOT_OUTCOME_FAILED_NO_SPACE,
)


@pytest.fixture(params=["python", "native"])
def peer(request, tmp_path, monkeypatch):
    """(stub, store, service) of a node's service on loopback, on each gRPC transport's server
    (gRPC C++ where it is built), called by grpcio's client."""
    if request.param == "native" and _grpc.native() is None:
        pytest.skip("gRPC C++ is not installed (pkg-config grpc++)")
    monkeypatch.setenv("MORI_UMBP_GRPC", request.param)
    monkeypatch.setenv("UMBP_PENDING_SLOT_TTL_MS", "400")
    monkeypatch.setenv("UMBP_DRAM_READ_LEASE_MS", "300")
    store = LocalStore(small_config(tmp_path, dram=256 * KiB, ssd=False))
    service = _peer.PeerService(store, b"engine", b"buffer", 64 * KiB)
    server = _peer.serve(service, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield pb_grpc.UMBPPeerStub(channel), store, service
    channel.close()
    server.stop(0)
    service.close()
    store.close()


def _allocate(stub, *entries: tuple[str, int]):
    request = pb.BatchAllocateSlotsRequest()
    for key, size in entries:
        request.entries.add(key=key, size=size, tier=2, depth=-1)
    return stub.BatchAllocateSlots(request, timeout=5).entries


def _commit(stub, *pairs: tuple[int, str]) -> list[bool]:
    request = pb.BatchCommitSlotsRequest()
    for slot_id, key in pairs:
        request.entries.add(slot_id=slot_id, key=key)
    return list(stub.BatchCommitSlots(request, timeout=5).success)


def test_peer_info(peer) -> None:
    stub, store, _ = peer
    info = stub.GetPeerInfo(pb.GetPeerInfoRequest(), timeout=5)
    assert (info.engine_desc, info.buffer_desc, info.buffer_size, info.page_size) == (
        b"engine",
        b"buffer",
        store.buffer_size,
        4096,
    )


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([("", PAGE)], "must not be empty"),
        ([("k", 0)], r"size must be in \[1, 65536\]"),
        ([("k", 1 << 40)], "size must be in"),
        ([("k\0", PAGE)], "NUL"),
        ([("x" * 2000, PAGE)], "the most is 1024"),
        ([("k", PAGE)] * (_peer.MAX_BATCH + 1), "the most is 4096"),
    ],
)
def test_malformed_requests_are_refused_whole(peer, entries, message) -> None:
    stub, store, _ = peer
    with pytest.raises(grpc.RpcError) as err:
        _allocate(stub, ("fine", PAGE), *entries)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and re.search(message, err.value.details())
    assert store.stats()["dram_used"] == 0 and not store.contains("fine")
    with pytest.raises(grpc.RpcError) as err:
        stub.BatchReleaseKeys(pb.BatchReleaseKeysRequest(keys=["a", "b"], lease_id=[1]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_allocate_commit_abort(peer) -> None:
    stub, store, _ = peer
    a, b = _allocate(stub, ("a", PAGE), ("b", PAGE))
    assert (a.outcome, b.outcome) == (OK, OK) and a.offset != b.offset and a.pending_ttl_ms == 400
    ctypes.memset(store.buffer_address + a.offset, 0x41, PAGE)
    assert _commit(stub, (a.slot_id, "not-a")) == [False]  # a slot commits only its own key
    assert _commit(stub, (a.slot_id, "a")) == [True]
    assert _commit(stub, (a.slot_id, "a")) == [False]
    assert list(stub.BatchAbortSlots(pb.BatchAbortSlotsRequest(slot_ids=[b.slot_id, 999]), timeout=5).success) == [
        True,
        True,
    ]
    assert store.contains("a") and not store.contains("b")
    assert _allocate(stub, ("a", PAGE))[0].outcome == EXISTS
    out = np.zeros(PAGE, np.uint8)
    assert store.read(["a"], [int(out.ctypes.data)], [PAGE]) == [True] and (out == 0x41).all()


def test_uncommitted_slots_are_reaped_after_their_ttl(peer) -> None:
    stub, store, _ = peer
    (slot,) = _allocate(stub, ("orphan", PAGE))
    assert store.stats()["dram_used"] == PAGE
    deadline = time.monotonic() + 10
    while store.stats()["dram_used"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.stats()["dram_used"] == 0
    assert _commit(stub, (slot.slot_id, "orphan")) == [False] and not store.contains("orphan")


def test_pending_slots_are_bounded(peer, monkeypatch) -> None:
    stub, store, _ = peer
    monkeypatch.setattr(_peer, "MAX_PENDING", 2)
    outcomes = [e.outcome for e in _allocate(stub, ("a", PAGE), ("b", PAGE), ("c", PAGE))]
    assert outcomes == [OK, OK, NO_SPACE] and not store.contains("c")


def test_read_leases(peer) -> None:
    stub, store, _ = peer
    (slot,) = _allocate(stub, ("k", PAGE))
    _commit(stub, (slot.slot_id, "k"))
    resolved = stub.BatchResolveKeys(pb.BatchResolveKeysRequest(keys=["k", "absent"]), timeout=5)
    assert list(resolved.found) == [True, False] and resolved.offset[0] == slot.offset
    assert resolved.size[0] == PAGE and resolved.lease_ms == 300
    lease = resolved.lease_id[0]
    # the master's advice leaves a leased key alone
    evicted = stub.EvictKey(pb.EvictKeyRequest(keys=["k", "absent"]), timeout=5).evicted
    assert [(e.key, e.bytes_freed) for e in evicted] == [("k", 0), ("absent", 0)]
    release = pb.BatchReleaseKeysRequest(keys=["k"], lease_id=[lease])
    assert list(stub.BatchReleaseKeys(release, timeout=5).held) == [True]
    # a lease that ran out does not hold: the reader must not trust its bytes
    lease = stub.BatchResolveKeys(pb.BatchResolveKeysRequest(keys=["k"]), timeout=5).lease_id[0]
    time.sleep(0.4)
    assert list(stub.BatchReleaseKeys(pb.BatchReleaseKeysRequest(keys=["k"], lease_id=[lease]), timeout=5).held) == [
        False
    ]
    # a key evicted meanwhile: its slot is held back until the lease ends, so the bytes read are its
    lease = stub.BatchResolveKeys(pb.BatchResolveKeysRequest(keys=["k"]), timeout=5).lease_id[0]
    assert store.evict("k") == PAGE and not store.contains("k")
    assert store.stats()["dram_used"] == PAGE  # not free for another value yet
    assert list(stub.BatchReleaseKeys(pb.BatchReleaseKeysRequest(keys=["k"], lease_id=[lease]), timeout=5).held) == [
        True
    ]
    assert store.stats()["dram_used"] == 0
    (again,) = _allocate(stub, ("k", PAGE))
    _commit(stub, (again.slot_id, "k"))
    assert list(stub.BatchReleaseKeys(pb.BatchReleaseKeysRequest(keys=["k"], lease_id=[lease]), timeout=5).held) == [
        False
    ]  # the key's new value is not the one that lease was for
    evicted = stub.EvictKey(pb.EvictKeyRequest(keys=["k"]), timeout=5).evicted
    assert evicted[0].bytes_freed == PAGE and not store.contains("k")
