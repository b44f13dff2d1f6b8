"""A node's reads from a peer (the master in its own process, pages moved by mori-io over TCP),
byte for byte: read leases released after the get returns, a read that outlived its lease asking
the owner and failing rather than trusting its bytes, and a batch of many megabytes read in parts
while the owner stages the next part from its SSD tier."""

from __future__ import annotations

import time

import numpy as np
import pytest
from _cluster_nodes import FAST_MASTER, KiB, node_config, row_ptrs, seeded_pages
from _master_harness import running_master, wait_until

from mori.umbp import UMBPClient, UMBPTierType, _cluster, _grpc
from mori.umbp._master._proto import umbp_peer_pb2 as pb

PAGE = 64 * KiB


@pytest.fixture()
def master():
    with running_master(FAST_MASTER) as m:
        yield m


def _owner_and_reader(master, tmp_path, count: int, size: int, dram: int) -> tuple[UMBPClient, UMBPClient, np.ndarray]:
    """A node holding ``count`` pages of ``size`` bytes (those beyond its ``dram`` on its SSD tier),
    and a node without them; and the pages."""
    owner = UMBPClient(node_config(master.address, "owner", tmp_path / "owner", dram=dram))
    src = seeded_pages(5, count, size)
    keys = [f"r{i}" for i in range(count)]
    owner.register_memory(int(src.ctypes.data), src.nbytes)
    assert all(owner.batch_put_from_ptr(keys, row_ptrs(src), [size] * count))  # the only node: all here
    assert owner.flush()
    try:
        reader = UMBPClient(node_config(master.address, "reader", None))
    except BaseException:
        owner.close()
        raise
    wait_until(lambda: reader.batch_exists_consecutive(keys) == count, 10, "every key visible to the reader")
    return owner, reader, src


def _leases(owner: UMBPClient) -> int:
    """Read leases the owner's store holds: on its slots and on slots held back for them."""
    store = owner._store
    assert store is not None
    with store._lock:
        return sum(len(e.leases or ()) for e in store._index.values()) + len(store._held)


def test_a_read_releases_its_leases_after_the_get_returns(master, tmp_path) -> None:
    owner, reader, src = _owner_and_reader(master, tmp_path, 8, PAGE, 4 << 20)
    try:
        keys = [f"r{i}" for i in range(8)]
        dst = np.zeros_like(src)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 8))
        assert np.array_equal(src, dst)
        wait_until(lambda: _leases(owner) == 0, 10, "the reader's leases released")
    finally:
        reader.close()
        owner.close()


def test_a_read_that_outlived_its_lease_asks_the_owner_and_fails(master, tmp_path, monkeypatch) -> None:
    owner, reader, src = _owner_and_reader(master, tmp_path, 4, PAGE, 4 << 20)
    try:
        keys = [f"r{i}" for i in range(4)]
        dst = np.zeros_like(src)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        monkeypatch.setattr(_cluster, "LEASE_TRUST", 0.0)  # no read is trusted: each asks the owner
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 4))  # the leases held
        assert np.array_equal(src, dst) and _leases(owner) == 0
        node = reader._cluster
        real_read = node.transport.read

        def slow_read(peer, moves):  # the owner's lease (500 ms) runs out before the read ends
            done = real_read(peer, moves)
            time.sleep(0.6)
            return done

        monkeypatch.setattr(node.transport, "read", slow_read)
        assert reader.batch_get_into_ptr(keys, row_ptrs(dst), [PAGE] * 4) == [False] * 4
    finally:
        reader.close()
        owner.close()


def test_a_batch_of_many_megabytes_is_read_in_parts_from_the_owners_ssd(master, tmp_path, monkeypatch) -> None:
    """12 MiB from an owner with 4 MiB of DRAM: read in parts of 4 MiB, the next part staged from
    SSD while one moves; parts the owner has no room for come in later rounds."""
    size, count = 256 * KiB, 48
    owner, reader, src = _owner_and_reader(master, tmp_path, count, size, 4 << 20)
    try:
        assert owner.stats()["ssd_keys"] >= count - 16
        node = reader._cluster
        parts: list[int] = []
        real = node._read_in_parts
        monkeypatch.setattr(node, "_read_in_parts", lambda *a: parts.append(1) or real(*a))
        keys = [f"r{i}" for i in range(count)]
        dst = np.zeros_like(src)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert all(reader.batch_get_into_ptr(keys, row_ptrs(dst), [size] * count))
        assert np.array_equal(src, dst) and parts == [1]
        wait_until(lambda: _leases(owner) == 0, 10, "the reader's leases released")
    finally:
        reader.close()
        owner.close()


def test_a_read_the_owner_has_no_room_for_waits_for_the_readers_own_releases(master, tmp_path, monkeypatch) -> None:
    """A get whose pages fill the owner's DRAM releases its leases in the background; a get right
    after it, of SSD pages, finds no room until those releases arrive, and waits for them rather
    than missing."""
    size, count = 256 * KiB, 32
    owner, reader, src = _owner_and_reader(master, tmp_path, count, size, 4 << 20)
    try:
        store = owner._store
        assert store is not None
        with store._lock:
            in_dram = {key for key, e in store._index.items() if e.dram is not None}
        keys = [f"r{i}" for i in range(count)]
        ssd_only = [i for i, key in enumerate(keys) if key not in in_dram]
        room = 16 - len(in_dram)  # 4 MiB of 256 KiB pages
        first = [i for i, key in enumerate(keys) if key in in_dram] + ssd_only[:room]
        later = ssd_only[room : room + 8]
        assert len(first) == 16 and len(later) == 8
        releaser = reader._cluster._releaser
        real_send = releaser._send

        def slow_send(*args):  # the releases arrive 0.3 s late, well within the 0.5 s leases
            time.sleep(0.3)
            real_send(*args)

        monkeypatch.setattr(releaser, "_send", slow_send)
        dst = np.zeros_like(src)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        rows = row_ptrs(dst)
        for batch in (first, later):
            got = reader.batch_get_into_ptr([keys[i] for i in batch], [rows[i] for i in batch], [size] * len(batch))
            assert all(got), batch
        read = first + later
        assert np.array_equal(src[read], dst[read])
    finally:
        reader.close()
        owner.close()


@pytest.mark.parametrize(("reserve_mb", "inline"), [("16", ""), ("16", "0"), ("0", "")])
def test_pages_on_the_owners_ssd_only_are_read(master, tmp_path, monkeypatch, reserve_mb, inline) -> None:
    """A get of pages the owner holds on SSD only, one page and a batch, byte for byte: with the
    reserve (and gRPC C++), the owner answers in C++ and the pages stay on its SSD only, the one
    page in the answer itself (over TCP, unless ``UMBP_PEER_INLINE_MAX_BYTES=0``), the batch of
    448 KiB leased and read with mori-io, its leases released after the get; without the
    reserve, the owner's Python stages them into its DRAM tier, as it always did."""
    monkeypatch.setenv("UMBP_PEER_SSD_RESERVE_MB", reserve_mb)
    monkeypatch.setenv("UMBP_PEER_INLINE_MAX_BYTES", inline)
    native = reserve_mb != "0" and _grpc.native() is not None
    owner, reader, src = _owner_and_reader(master, tmp_path, 8, PAGE, 4 << 20)
    try:
        store = owner._store
        assert store is not None and (store.reserve_bytes > 0) == native
        keys = [f"r{i}" for i in range(8)]
        for key in keys:
            store.demote(key)  # each leaves DRAM for SSD
        assert owner.flush()
        assert all(store.lookup(key) == (UMBPTierType.SSD, PAGE) for key in keys)
        dst = np.zeros_like(src)
        reader.register_memory(int(dst.ctypes.data), dst.nbytes)
        assert reader.batch_get_into_ptr(keys[:1], row_ptrs(dst)[:1], [PAGE]) == [True]
        assert all(reader.batch_get_into_ptr(keys[1:], row_ptrs(dst)[1:], [PAGE] * 7))
        assert np.array_equal(src, dst)
        tier = UMBPTierType.SSD if native else UMBPTierType.DRAM
        assert all(store.lookup(key) == (tier, PAGE) for key in keys)
        if native:
            reads = owner._cluster._service.ssd_reads
            assert reads.inlined == (0 if inline == "0" else 1)
            wait_until(lambda: reads.leases == 0, 10, "the reader's leases on the reserve released")
            assert reads.reserve_used == 0
        wait_until(lambda: _leases(owner) == 0, 10, "the reader's leases released")
    finally:
        reader.close()
        owner.close()


def test_an_inline_answer_that_does_not_add_up_copies_nothing() -> None:
    """The bytes of an answer are copied only when they are the sizes answered, page for page:
    a page of another size than asked for is a miss, and an answer whose bytes do not add up (or
    lists a page as not found) is all misses, with the destinations untouched."""
    src = np.arange(3 * 16, dtype=np.uint8).reshape(3, 16)
    dst = np.zeros_like(src)
    ptrs = row_ptrs(dst)

    def answer(sizes: list[int], data: bytes, found: list[bool] | None = None) -> pb.BatchResolveKeysResponse:
        return pb.BatchResolveKeysResponse(found=found or [True] * len(sizes), size=sizes, inline_pages=data)

    assert _cluster._copy_inline(answer([16, 16, 16], src.tobytes()), ptrs, [16, 16, 16]) == [True] * 3
    assert np.array_equal(src, dst)
    dst[:] = 0
    assert _cluster._copy_inline(answer([16, 8, 16], src.tobytes()[:40]), ptrs, [16, 16, 16]) == [True, False, True]
    assert dst[0].tobytes() == src[0].tobytes() and not dst[1].any() and dst[2].tobytes() == src.tobytes()[24:40]
    dst[:] = 0
    for bad in (answer([16, 16, 16], src.tobytes()[:47]), answer([16, 16], src.tobytes()[:32])):
        assert _cluster._copy_inline(bad, ptrs, [16, 16, 16]) == [False] * 3
    assert (
        _cluster._copy_inline(answer([16, 16, 16], src.tobytes(), [True, False, True]), ptrs, [16] * 3) == [False] * 3
    )
    assert not dst.any()
