"""The node's store seam that a peer service and a heartbeat use: allocate, commit, abort,
resolve with a lease, evict, the buffer for mori-io, and the KvEvent of every change."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from _pool import KiB, addr, pages, small_config

from mori.umbp import UMBPTierType
from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._store import LocalStore, StoreClosedError, StoreFullError

PAGE = 16 * KiB
ADD, REMOVE = KvEventType.ADD, KvEventType.REMOVE
DRAM, SSD = UMBPTierType.DRAM, UMBPTierType.SSD


@pytest.fixture()
def store(tmp_path):
    made = LocalStore(small_config(tmp_path, dram=64 * KiB))
    yield made
    made.close()


def _events(store: LocalStore) -> list[KvEvent]:
    seen: list[KvEvent] = []
    store.subscribe(seen.append)
    return seen


def test_allocate_write_commit(store: LocalStore) -> None:
    events = _events(store)
    src = pages(1, PAGE)
    slot = store.allocate("k", PAGE, depth=3)
    assert slot is not None and store.buffer_address <= slot.address < store.buffer_address + store.buffer_size
    assert slot.address == store.buffer_address + slot.offset and slot.offset % 4096 == 0
    assert not store.contains("k")  # invisible until committed
    assert store.allocate("k", PAGE) is None  # being stored already
    ctypes.memmove(slot.address, addr(src), PAGE)
    assert store.commit(slot)
    assert events == [KvEvent(ADD, "k", DRAM, PAGE, 3)]
    dst = np.zeros((1, PAGE), np.uint8)
    assert store.read(["k"], [addr(dst)], [PAGE]) == [True] and np.array_equal(src, dst)
    with pytest.raises(ValueError, match="committed already"):
        store.commit(slot)


def test_abort_frees_the_slot(store: LocalStore) -> None:
    events = _events(store)
    slot = store.allocate("k", PAGE)
    assert slot is not None
    store.abort(slot)
    assert not store.contains("k") and events == [] and store.stats()["dram_used"] == 0
    assert store.allocate("k", PAGE) is not None


def test_clear_while_a_slot_is_written_frees_it_at_commit(store: LocalStore) -> None:
    slot = store.allocate("k", PAGE)
    assert slot is not None
    store.clear()
    assert store.stats()["dram_used"] == PAGE  # the writer still holds it
    assert not store.commit(slot)
    assert store.stats()["dram_used"] == 0 and not store.contains("k")


def test_moving_to_ssd_is_add_then_remove_and_resolve_stages_back(store: LocalStore) -> None:
    events = _events(store)
    src = pages(5, PAGE)
    for i in range(5):  # 4 pages fit: the fifth puts the first over the watermark
        assert store.write(f"k{i}", addr(src, i), PAGE)
    assert store.flush()
    moved = [e for e in events if e.tier == SSD]
    assert moved and all(e.type == ADD for e in moved)
    for event in moved:  # each page: ADD on SSD, then REMOVE on DRAM, in that order
        i = events.index(event)
        assert events[i + 1] == KvEvent(REMOVE, event.key, DRAM, PAGE, -1)
    key = moved[0].key
    assert store.lookup(key) == (SSD, PAGE)
    events.clear()
    slot = store.resolve(key, lease_s=5.0)
    assert slot is not None and store.lookup(key) == (DRAM, PAGE)
    assert events[0] == KvEvent(ADD, key, DRAM, PAGE, -1)
    row = int(key[1:])
    assert ctypes.string_at(slot.address, PAGE) == src[row].tobytes()


def test_a_leased_page_stays_put(tmp_path) -> None:
    store = LocalStore(small_config(tmp_path, dram=64 * KiB, ssd=False))
    try:
        src = pages(8, PAGE)
        store.write("leased", addr(src, 0), PAGE)
        slot = store.resolve("leased", lease_s=60.0)
        assert slot is not None
        for i in range(1, 8):
            store.write(f"k{i}", addr(src, i), PAGE)
        assert store.contains("leased") and not store.contains("k1")
        again = store.resolve("leased", lease_s=60.0)  # a second reader: a lease of its own
        assert again is not None and again.lease_id != slot.lease_id
        assert store.release("leased", slot.lease_id) and not store.release("leased", slot.lease_id)
        assert store.release("leased", again.lease_id)
        for i in range(8, 12):
            store.write(f"k{i}", addr(src, i % 8), PAGE)
        assert not store.contains("leased")
    finally:
        store.close()


def test_a_slot_dropped_while_leased_is_held_back_until_its_leases_end(tmp_path) -> None:
    """A reader within its lease reads the value's bytes even when the key is dropped meanwhile:
    the slot is not another value's until every lease on it has been released or has run out."""
    cfg = small_config(tmp_path, dram=64 * KiB, ssd=False)  # four pages
    cfg.dram.high_watermark, cfg.dram.low_watermark = 1.0, 1.0
    store = LocalStore(cfg)
    try:
        src = pages(8, PAGE)
        store.write("k0", addr(src, 0), PAGE)
        long, short = store.resolve("k0", lease_s=60.0), store.resolve("k0", lease_s=0.2)
        assert long is not None and short is not None and long.offset == short.offset
        assert store.evict("k0") == PAGE and not store.contains("k0")
        for i in range(1, 8):  # more pages than DRAM holds: the older ones make room, k0's slot does not
            assert store.write(f"k{i}", addr(src, i), PAGE)
        assert ctypes.string_at(long.address, PAGE) == src[0].tobytes()
        assert store.stats()["dram_keys"] == 3  # three slots for values, the fourth held
        time.sleep(0.3)
        assert not store.release("k0", short.lease_id)  # it ran out; the other lease still holds the slot
        assert not store.release("k1", long.lease_id)  # another key's lease id is not k0's
        assert store.stats()["dram_used"] == 64 * KiB
        assert store.release("k0", long.lease_id) and not store.release("k0", long.lease_id)
        assert store.stats()["dram_used"] == 48 * KiB  # the slot is free now
        slot = store.resolve("k7", lease_s=0.05)
        assert slot is not None and store.evict("k7") == PAGE
        time.sleep(0.1)  # a held slot whose lease ran out is freed without a release
        assert store.stats()["dram_used"] == 32 * KiB
    finally:
        store.close()


def test_full_of_leased_pages_is_store_full(tmp_path) -> None:
    cfg = small_config(tmp_path, dram=32 * KiB, ssd=False)
    cfg.dram.high_watermark, cfg.dram.low_watermark = 1.0, 0.5  # two pages stay without eviction
    store = LocalStore(cfg)
    try:
        src = pages(2, PAGE)
        for i in range(2):
            store.write(f"k{i}", addr(src, i), PAGE)
            store.resolve(f"k{i}", lease_s=0.3)
        started = time.monotonic()
        with pytest.raises(StoreFullError, match="no room in DRAM"):
            store.allocate("more", PAGE, timeout=0.1)
        assert time.monotonic() - started < 10
        slot = store.allocate("later", PAGE, timeout=10.0)  # the leases run out
        assert slot is not None
        store.abort(slot)
    finally:
        store.close()


def test_evict_removes_from_every_tier(store: LocalStore) -> None:
    src = pages(6, PAGE)
    for i in range(6):
        store.write(f"k{i}", addr(src, i), PAGE)
    store.flush()
    events = _events(store)
    on_ssd = next(f"k{i}" for i in range(6) if store.lookup(f"k{i}") == (SSD, PAGE))
    assert store.evict(on_ssd) == PAGE and not store.contains(on_ssd)
    assert events == [KvEvent(REMOVE, on_ssd, SSD, PAGE, -1)]
    assert store.evict(on_ssd) == 0
    assert store.evict("k5") and events[-1] == KvEvent(REMOVE, "k5", DRAM, PAGE, -1)


def test_a_listener_that_raises_does_not_break_the_store(store: LocalStore) -> None:
    def broken(event: KvEvent) -> None:
        raise RuntimeError("listener bug")

    store.subscribe(broken)
    src = pages(1, PAGE)
    assert store.write("k", addr(src), PAGE) and store.contains("k")


def test_closed_store_refuses(tmp_path) -> None:
    store = LocalStore(small_config(tmp_path))
    store.close()
    with pytest.raises(StoreClosedError):
        store.allocate("k", PAGE)
    store.close()


def test_demote_frees_the_fastest_tier(store: LocalStore) -> None:
    src = pages(2, PAGE)
    store.write("a", addr(src, 0), PAGE)
    store.write("b", addr(src, 1), PAGE)
    events = _events(store)
    assert store.demote("a") == PAGE and store.flush()
    assert store.lookup("a") == (SSD, PAGE)  # moved down, not lost
    assert events == [KvEvent(ADD, "a", SSD, PAGE, -1), KvEvent(REMOVE, "a", DRAM, PAGE, -1)]
    assert store.demote("a") == PAGE and not store.contains("a")  # only on SSD: it leaves
    slot = store.resolve("b", lease_s=60.0)
    assert slot is not None and store.demote("b") == 0  # leased: left alone
    assert store.demote("absent") == 0


def test_a_write_that_may_not_make_room_evicts_nothing(store: LocalStore) -> None:
    src = pages(4, PAGE)
    assert store.write("a", addr(src, 0), PAGE, make_room=False)  # 16 of 64 KiB: under the low mark
    assert store.write("b", addr(src, 1), PAGE, make_room=False)
    assert store.write("c", addr(src, 2), PAGE, make_room=False) is False  # 48 KiB is over 0.7 × 64
    assert store.write("c", addr(src, 2), PAGE) and store.write("d", addr(src, 3), PAGE)  # these may
    assert store.flush() and store.lookup("a") == (SSD, PAGE)
