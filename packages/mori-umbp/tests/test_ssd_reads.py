"""Pages staged back from the SSD tier in batches: neighbouring records read by one call, the
runs by the workers at once, byte for byte; a read that fails fails only its own pages."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
from _pool import KiB, addr, pages, small_config

from mori.umbp import UMBPTierType
from mori.umbp._extents import ALIGN
from mori.umbp._ssd import READ_RUN_BYTES, SsdRecord, read_runs
from mori.umbp._store import LocalStore

PAGE = 16 * KiB
SEGMENT = 64 * KiB  # four pages a segment: a batch of 16 spans four segment files
COUNT = 16


def test_read_runs_groups_neighbours_of_one_segment() -> None:
    page = ALIGN
    records = [
        SsdRecord(1, 0, page, 0),
        SsdRecord(0, page, 100, 0),  # 100 bytes take one aligned page
        SsdRecord(0, 0, page, 0),
        SsdRecord(0, 3 * page, page, 0),  # a gap before it
        SsdRecord(1, page, page, 0),
    ]
    assert read_runs(records) == [[2, 1], [3], [0, 4]]
    big = READ_RUN_BYTES // 2
    assert read_runs([SsdRecord(0, i * big, big, 0) for i in range(5)]) == [[0, 1], [2, 3], [4]]
    assert read_runs([SsdRecord(0, 0, 2 * READ_RUN_BYTES, 0)]) == [[0]]  # one record is never split
    assert read_runs([]) == []


@pytest.fixture()
def on_ssd(tmp_path):
    """A store whose COUNT pages are all on SSD only, four to a segment file; and the pages."""
    store = LocalStore(small_config(tmp_path, dram=1 << 20, segment=SEGMENT))
    src = pages(COUNT, PAGE, seed=7)
    for i in range(COUNT):
        assert store.write(f"k{i}", addr(src, i), PAGE)
    for i in range(COUNT):
        store.demote(f"k{i}")
    assert store.flush()
    assert all(store.lookup(f"k{i}") == (UMBPTierType.SSD, PAGE) for i in range(COUNT))
    yield store, src
    store.close()


def _record(store: LocalStore, key: str) -> SsdRecord:
    record = store._index[key].ssd
    assert record is not None
    return record


def test_a_batch_over_segment_files_is_staged_byte_for_byte(on_ssd) -> None:
    store, src = on_ssd
    assert len({_record(store, f"k{i}").segment for i in range(COUNT)}) == COUNT * PAGE // SEGMENT
    order = [5, 0, 15, 9, 3, 12, 1, 14, 6, 11, 2, 8, 13, 4, 10, 7]
    keys = [f"k{i}" for i in order] + ["absent", "k5"]  # one unknown, one asked twice
    slots = store.resolve_many(keys, lease_s=5.0)
    assert slots[-2] is None
    for key, slot in zip(keys[:-2] + keys[-1:], slots[:-2] + slots[-1:]):
        assert slot is not None and slot.key == key and slot.size == PAGE
        assert ctypes.string_at(slot.address, PAGE) == src[int(key[1:])].tobytes()
        assert store.lookup(key) == (UMBPTierType.DRAM, PAGE)
    assert slots[0] is not None and slots[-1] is not None and slots[0].offset == slots[-1].offset
    for key, slot in zip(keys[:-2], slots[:-2]):  # one lease a key, however often it was asked
        assert slot is not None and store.release(key, slot.lease_id)
    dst = np.zeros_like(src)  # the pages kept their SSD copies: demoted again, read again
    for i in range(COUNT):
        store.demote(f"k{i}")
    assert (
        store.read([f"k{i}" for i in range(COUNT)], [addr(dst, i) for i in range(COUNT)], [PAGE] * COUNT)
        == [True] * COUNT
    )
    assert np.array_equal(src, dst)


def test_a_corrupt_page_fails_alone(on_ssd) -> None:
    store, src = on_ssd
    bad = _record(store, "k6")
    fd = os.open(store._ssd._path(bad.segment), os.O_WRONLY)
    try:
        os.pwrite(fd, bytes(64), bad.offset + 100)
    finally:
        os.close(fd)
    keys = [f"k{i}" for i in range(COUNT)]
    slots = store.resolve_many(keys, lease_s=5.0)
    assert [slot is None for slot in slots] == [key == "k6" for key in keys]
    for key, slot in zip(keys, slots):
        if slot is not None:
            assert ctypes.string_at(slot.address, PAGE) == src[int(key[1:])].tobytes()
    assert store.lookup("k6") == (UMBPTierType.SSD, PAGE)  # still stored, still failing
    assert store.resolve("k6", lease_s=5.0) is None


def test_a_failed_run_fails_only_its_pages(on_ssd) -> None:
    store, src = on_ssd
    lost = _record(store, "k9").segment
    os.truncate(store._ssd._path(lost), 0)  # its records now read short
    keys = [f"k{i}" for i in range(COUNT)]
    slots = store.resolve_many(keys, lease_s=5.0)
    failed = {key for key, slot in zip(keys, slots) if slot is None}
    assert failed == {key for key in keys if _record(store, key).segment == lost} and len(failed) == SEGMENT // PAGE
    for key, slot in zip(keys, slots):
        if slot is not None:
            assert ctypes.string_at(slot.address, PAGE) == src[int(key[1:])].tobytes()
    stats = store.stats()
    assert stats["dram_used"] == (COUNT - len(failed)) * PAGE  # the failed pages' DRAM slots were freed


def test_pages_without_room_in_dram_are_not_read_and_come_next_round(tmp_path, monkeypatch) -> None:
    store = LocalStore(small_config(tmp_path, dram=64 * KiB, segment=SEGMENT))
    try:
        src = pages(8, PAGE, seed=3)
        keys = [f"k{i}" for i in range(8)]
        for i, key in enumerate(keys):
            assert store.write(key, addr(src, i), PAGE)
            store.demote(key)
        assert store.flush()
        assert all(store.lookup(key) == (UMBPTierType.SSD, PAGE) for key in keys)
        read: list[str] = []
        read_run = store._ssd.read_run

        def counted(records, views):  # type: ignore[no-untyped-def]
            read.extend(f"{r.segment}:{r.offset}" for r in records)
            return read_run(records, views)

        monkeypatch.setattr(store._ssd, "read_run", counted)
        served: set[str] = set()
        for _ in range(8):  # rounds, as a remote reader does them: the leases end between them
            todo = [key for key in keys if key not in served]
            if not todo:
                break
            slots = store.resolve_many(todo, lease_s=5.0)
            got = [(key, slot) for key, slot in zip(todo, slots) if slot is not None]
            assert got and len(got) < 8  # some, never all: 64 KiB of DRAM takes at most four
            for key, slot in got:
                assert ctypes.string_at(slot.address, PAGE) == src[int(key[1:])].tobytes()
                assert store.release(key, slot.lease_id)
                served.add(key)
                store.demote(key)  # back to SSD only, so the next round has the room
        assert served == set(keys)
        assert len(read) == len(keys)  # each page read once: none read only to be dropped
    finally:
        store.close()
