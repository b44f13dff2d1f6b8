"""A peer service's resolves of pages on SSD only, answered in C++ (``_grpc_native.PeerSsdReads``
on the gRPC C++ server): the page read into a slot of the reserve after the DRAM tier, byte for
byte, under a lease of its own, or in the answer itself when the reader allows it; what that path does not take (a key in DRAM, a duplicate, no room
in the reserve, a failed read, malformed input) answered by the Python service as before; a key
evicted while leased or while read never answers other bytes."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

import grpc
import numpy as np
import pytest
from _pool import KiB, addr, pages, small_config

from mori.umbp import UMBPTierType, _grpc, _peer
from mori.umbp._master._proto import umbp_peer_pb2 as pb
from mori.umbp._master._proto import umbp_peer_pb2_grpc as pb_grpc
from mori.umbp._store import LocalStore

pytestmark = pytest.mark.skipif(
    isinstance(_grpc._load_native(), ImportError), reason="gRPC C++ is not installed (pkg-config grpc++)"
)

PAGE = 64 * KiB
RESERVE = 1 << 20  # 16 pages
LEASE_MS = 300


class Node:
    """A store with an SSD tier and its peer service on the C++ server, called by grpcio."""

    def __init__(self, tmp_path, monkeypatch, verify_crc: bool = True, reserve: int = RESERVE) -> None:
        monkeypatch.setenv("MORI_UMBP_GRPC", "native")
        monkeypatch.setenv("UMBP_DRAM_READ_LEASE_MS", str(LEASE_MS))
        cfg = small_config(tmp_path, dram=1 << 20, segment=1 << 20)
        cfg.ssd.verify_crc = verify_crc
        self.store = LocalStore(cfg, reserve)
        self.service = _peer.PeerService(self.store, b"engine", b"buffer", 1 << 20)
        self.server = _peer.serve(self.service, "127.0.0.1", 0)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.UMBPPeerStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0)
        self.service.close()
        self.store.close()

    def put_on_ssd(self, keys: list[str], data: np.ndarray) -> None:
        for i, key in enumerate(keys):
            assert self.store.write(key, addr(data, i), data.shape[1])
            self.store.demote(key)
        assert self.store.flush()
        assert all(self.store.lookup(k) == (UMBPTierType.SSD, data.shape[1]) for k in keys)
        assert all(self.store._index[k].dram is None for k in keys)

    def resolve(self, *keys: str, inline_max: int = 0):
        request = pb.BatchResolveKeysRequest(keys=list(keys), inline_max_bytes=inline_max)
        return self.stub.BatchResolveKeys(request, timeout=5)

    def release(self, keys: list[str], leases: list[int]) -> list[bool]:
        request = pb.BatchReleaseKeysRequest(keys=keys, lease_id=leases)
        return list(self.stub.BatchReleaseKeys(request, timeout=5).held)

    def slot_bytes(self, offset: int, size: int) -> bytes:
        return ctypes.string_at(self.store.buffer_address + offset, size)


@pytest.fixture()
def node(tmp_path, monkeypatch):
    n = Node(tmp_path, monkeypatch)
    yield n
    n.close()


LEASE_BIT = 1 << 62


def test_ssd_pages_are_read_into_the_reserve_under_leases_of_their_own(node) -> None:
    data = pages(4, PAGE, seed=3)
    keys = [f"k{i}" for i in range(4)]
    node.put_on_ssd(keys, data)
    got = node.resolve(*keys)
    assert list(got.found) == [True] * 4 and list(got.size) == [PAGE] * 4
    assert list(got.tier) == [int(UMBPTierType.DRAM)] * 4 and got.lease_ms == LEASE_MS and got.page_size == 4096
    assert all(lease & LEASE_BIT for lease in got.lease_id)
    for i, offset in enumerate(got.offset):
        assert node.store.buffer_size <= offset and offset + PAGE <= node.store.registered_size
        assert node.slot_bytes(offset, PAGE) == data[i].tobytes()
    # read where they lie: still on SSD only, and the DRAM tier untouched
    assert all(node.store.lookup(k) == (UMBPTierType.SSD, PAGE) for k in keys)
    assert node.store.stats()["dram_used"] == 0
    reads = node.service.ssd_reads
    assert reads.leases == 4 and reads.reserve_used == 4 * PAGE
    assert node.release(keys, list(got.lease_id)) == [True] * 4
    assert reads.leases == 0 and reads.reserve_used == 0
    assert node.release(keys[:1], list(got.lease_id[:1])) == [False]  # ended already
    assert sorted(reads.take_hits()) == keys


def test_small_pages_come_in_the_answer_when_the_reader_allows_it(node) -> None:
    """Pages on SSD only whose bytes add up to at most the reader's ``inline_max_bytes`` come in
    the answer, in key order, with nothing leased and the reserve free again at once; more bytes
    than that, or no such ask, and they are leased as before."""
    data = pages(4, PAGE, seed=13)
    keys = [f"k{i}" for i in range(4)]
    node.put_on_ssd(keys, data)
    reads = node.service.ssd_reads
    got = node.resolve(*keys[:2], inline_max=2 * PAGE)
    assert got.inline_pages == data[:2].tobytes()
    assert list(got.found) == [True, True] and list(got.size) == [PAGE, PAGE]
    assert list(got.lease_id) == [0, 0] and list(got.offset) == [0, 0]
    assert reads.leases == 0 and reads.reserve_used == 0 and reads.inlined == 2
    assert sorted(reads.take_hits()) == keys[:2]
    over = node.resolve(*keys[1:], inline_max=3 * PAGE - 1)  # one byte short: leased
    assert over.inline_pages == b"" and all(lease & LEASE_BIT for lease in over.lease_id)
    assert [node.slot_bytes(o, PAGE) for o in over.offset] == [d.tobytes() for d in data[1:]]
    assert node.release(keys[1:], list(over.lease_id)) == [True] * 3
    assert node.resolve(keys[0]).inline_pages == b""  # not asked for
    assert reads.inlined == 2 and all(node.store.lookup(k) == (UMBPTierType.SSD, PAGE) for k in keys)


def test_an_answer_carries_at_most_a_mebibyte_inline_whatever_the_reader_asks(tmp_path, monkeypatch) -> None:
    n = Node(tmp_path, monkeypatch, reserve=2 << 20)
    try:
        count = (1 << 20) // PAGE + 1
        data = pages(count, PAGE, seed=14)
        keys = [f"k{i}" for i in range(count)]
        n.put_on_ssd(keys, data)
        assert n.resolve(*keys[:-1], inline_max=1 << 40).inline_pages == data[:-1].tobytes()  # 1 MiB: at the bound
        past = n.resolve(*keys, inline_max=1 << 40)
        assert past.inline_pages == b"" and all(lease & LEASE_BIT for lease in past.lease_id)
        assert n.release(keys, list(past.lease_id)) == [True] * count
    finally:
        n.close()


def test_what_the_c_path_does_not_take_python_answers(node) -> None:
    data = pages(3, PAGE, seed=4)
    node.put_on_ssd(["a", "b"], data[:2])
    assert node.store.write("dram", addr(data, 2), PAGE)
    mixed = node.resolve("a", "dram", inline_max=1 << 20)  # a key in DRAM: the store's path, which stages "a"
    assert list(mixed.found) == [True, True] and not any(lease & LEASE_BIT for lease in mixed.lease_id)
    assert mixed.inline_pages == b""  # the store's path always leases
    assert node.slot_bytes(mixed.offset[0], PAGE) == data[0].tobytes()
    assert node.store.lookup("a") == (UMBPTierType.DRAM, PAGE)  # staged into the DRAM tier
    assert node.release(["a", "dram"], list(mixed.lease_id)) == [True, True]
    twice = node.resolve("b", "b")  # a duplicate: one lease a key, as the store gives it
    assert twice.lease_id[0] == twice.lease_id[1] and not twice.lease_id[0] & LEASE_BIT
    absent = node.resolve("nowhere")
    assert list(absent.found) == [False]


def test_a_key_evicted_while_leased_keeps_its_bytes_until_the_lease_ends(node) -> None:
    data = pages(2, PAGE, seed=5)
    node.put_on_ssd(["k"], data[:1])
    got = node.resolve("k")
    offset, lease = got.offset[0], got.lease_id[0]
    assert node.store.evict("k") == PAGE and not node.store.contains("k")
    node.put_on_ssd(["other"], data[1:])  # may take the record's place on SSD
    assert node.slot_bytes(offset, PAGE) == data[0].tobytes()
    assert node.release(["k"], [lease]) == [True]
    assert list(node.resolve("k").found) == [False]


def test_a_lease_that_ran_out_does_not_hold_and_its_slot_comes_back(tmp_path, monkeypatch) -> None:
    n = Node(tmp_path, monkeypatch, reserve=4 * PAGE)
    try:
        data = pages(6, PAGE, seed=6)
        keys = [f"k{i}" for i in range(6)]
        n.put_on_ssd(keys, data)
        first = n.resolve(*keys[:4])  # fills the reserve
        assert all(lease & LEASE_BIT for lease in first.lease_id)
        full = n.resolve("k4")  # no room in it: the store stages the page instead
        assert list(full.found) == [True] and not full.lease_id[0] & LEASE_BIT
        assert n.slot_bytes(full.offset[0], PAGE) == data[4].tobytes()
        assert n.release(["k4"], [full.lease_id[0]]) == [True]
        time.sleep(LEASE_MS / 1000 + 0.1)
        later = n.resolve("k5")  # the leases that ran out gave their slots back
        assert later.lease_id[0] & LEASE_BIT and n.slot_bytes(later.offset[0], PAGE) == data[5].tobytes()
        assert n.service.ssd_reads.leases == 1
        assert n.release(keys[:1], [first.lease_id[0]]) == [False]  # it ran out: the reader must not trust it
        assert n.release(["k5"], [later.lease_id[0]]) == [True]
    finally:
        n.close()


def test_a_record_that_does_not_match_its_checksum_is_a_miss(node) -> None:
    data = pages(1, PAGE, seed=8)
    node.put_on_ssd(["k"], data)
    record = node.store._index["k"].ssd
    with mmap.mmap(-1, 4096) as garbage:  # page-aligned, as O_DIRECT wants it
        garbage.write(b"\xff" * 4096)
        assert os.pwritev(node.store._ssd.fd(record.segment), [garbage], record.offset) == 4096
    got = node.resolve("k")  # the C path's check fails: the store reads it again, and says miss
    assert list(got.found) == [False]
    assert node.service.ssd_reads.leases == 0 and node.service.ssd_reads.reserve_used == 0


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ([""], "must not be empty"),
        (["k\0"], "NUL"),
        (["x" * 1025], "the most is 1024"),
        (["k"] * 4097, "the most is 4096"),
    ],
)
def test_malformed_resolves_are_refused_as_before(node, keys, message) -> None:
    node.put_on_ssd(["k"], pages(1, PAGE, seed=9))
    with pytest.raises(grpc.RpcError) as err:
        node.resolve(*keys)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert node.service.ssd_reads.leases == 0


def test_malformed_releases_are_refused_and_a_wrong_key_does_not_hold(node) -> None:
    node.put_on_ssd(["k"], pages(1, PAGE, seed=10))
    lease = node.resolve("k").lease_id[0]
    with pytest.raises(grpc.RpcError) as err:
        node.release(["k", "k"], [lease])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "2 keys but 1 lease_ids" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        node.release([""], [lease])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert node.release(["other"], [lease]) == [False]  # not that key's lease
    assert node.release(["k"], [lease | 12345]) == [False]  # not a lease at all
    assert node.release(["k"], [lease]) == [True]  # untouched by the refusals


def test_a_request_that_does_not_decode_is_refused_as_before(node) -> None:
    call = node.channel.unary_unary("/umbp.UMBPPeer/BatchResolveKeys")
    with pytest.raises(grpc.RpcError) as err:
        call(b"\x0a\xff\xff", timeout=5)  # a length past the end
    assert err.value.code() == grpc.StatusCode.INTERNAL


def test_reads_racing_evictions_and_new_values_never_answer_other_bytes(tmp_path, monkeypatch) -> None:
    """Without checksums, only the C path's second look at each key keeps a read of a record
    freed and written over meanwhile from being answered: a key is evicted and put again with
    new bytes while it is resolved, and every page answered is one whole value of that key."""
    n = Node(tmp_path, monkeypatch, verify_crc=False)
    try:
        versions = pages(8, PAGE, seed=11)
        filler = pages(1, PAGE, seed=12)
        n.put_on_ssd(["k"], versions[:1])
        stop = threading.Event()
        answered: list[bytes] = []
        native = [0]
        served = threading.Event()  # a read answered in C++ since the last put
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not stop.is_set():
                    got = n.resolve("k")
                    if got.found[0]:
                        answered.append(n.slot_bytes(got.offset[0], PAGE))
                        if got.lease_id[0] & LEASE_BIT:
                            native[0] += 1
                            served.set()
                        n.release(["k"], [got.lease_id[0]])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            for round_ in range(40):
                served.wait(10)  # the page on SSD only was read at least once in C++
                n.store.evict("k")
                n.put_on_ssd([f"fill{round_}"], filler)  # reuses the freed record's place
                n.store.evict(f"fill{round_}")
                served.clear()
                n.put_on_ssd(["k"], versions[round_ % 8 : round_ % 8 + 1])
        finally:
            stop.set()
            thread.join(30)
        assert not errors and native[0] > 0
        whole = {v.tobytes() for v in versions}
        assert all(page in whole for page in answered)
    finally:
        n.close()


def test_the_reserve_is_checked() -> None:
    module = _grpc._load_native()
    with pytest.raises(ValueError, match="multiples of 4096"):
        module.PeerSsdReads(4096, 0, 100, 300, True)
    with pytest.raises(ValueError, match="lease_ms"):
        module.PeerSsdReads(4096, 0, 4096, 0, True)


def test_without_the_cpp_transport_there_is_no_reserve(monkeypatch) -> None:
    monkeypatch.setenv("MORI_UMBP_GRPC", "python")
    assert _peer.ssd_reserve_bytes(True) == 0
    monkeypatch.setenv("MORI_UMBP_GRPC", "native")
    assert _peer.ssd_reserve_bytes(False) == 0
    assert _peer.ssd_reserve_bytes(True) == _peer.SSD_RESERVE_MB << 20
    monkeypatch.setenv("UMBP_PEER_SSD_RESERVE_MB", "0")
    assert _peer.ssd_reserve_bytes(True) == 0
