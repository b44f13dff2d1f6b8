"""UMBPClient on one node: every method, bytes checked byte for byte, the DRAM tier spilling to SSD
and reading back, and bad input refused before anything changes."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from _pool import KiB, addr, pages, small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.io import MemoryLocationType
from mori.umbp import UMBPClient, UMBPConfig, UMBPDeploymentMode, UMBPDurabilityMode, UMBPTierType
from mori.umbp._checks import check_key, check_keys

PAGE = 16 * KiB


def test_put_get_exists_byte_for_byte(make_client) -> None:
    client = make_client()
    src, dst = pages(1, PAGE), np.zeros((1, PAGE), np.uint8)
    assert not client.exists("p0")
    assert client.put_from_ptr("p0", addr(src), PAGE)
    assert client.exists("p0")
    assert client.get_into_ptr("p0", addr(dst), PAGE)
    assert np.array_equal(src, dst)


def test_a_stored_key_is_put_once(make_client) -> None:
    client = make_client()
    first, second, dst = pages(1, PAGE, 1), pages(1, PAGE, 2), np.zeros((1, PAGE), np.uint8)
    assert client.put_from_ptr("k", addr(first), PAGE)
    assert client.put_from_ptr("k", addr(second), PAGE)  # a success that leaves the value as it is
    assert client.get_into_ptr("k", addr(dst), PAGE)
    assert np.array_equal(dst, first)


def test_get_misses_are_false(make_client) -> None:
    client = make_client()
    src, dst = pages(1, PAGE), np.zeros((1, 2 * PAGE), np.uint8)
    assert not client.get_into_ptr("absent", addr(dst), PAGE)
    client.put_from_ptr("k", addr(src), PAGE)
    assert not client.get_into_ptr("k", addr(dst), 2 * PAGE)  # another size: a miss, nothing written
    assert not dst.any()


def test_batches_and_consecutive_exists(make_client) -> None:
    client = make_client(dram=4 << 20)
    src, dst = pages(64, PAGE), np.zeros((64, PAGE), np.uint8)
    keys = [f"page-{i}" for i in range(64)]
    assert client.batch_put_from_ptr(keys, [addr(src, i) for i in range(64)], [PAGE] * 64) == [True] * 64
    assert client.batch_exists(keys[:3] + ["nope"]) == [True, True, True, False]
    assert client.batch_exists_consecutive(keys) == 64
    assert client.batch_exists_consecutive(keys[:10] + ["nope"] + keys[10:]) == 10
    assert client.batch_exists_consecutive([]) == 0
    got = client.batch_get_into_ptr(keys + ["nope"], [addr(dst, i) for i in range(64)] + [addr(dst)], [PAGE] * 65)
    assert got == [True] * 64 + [False]
    assert np.array_equal(src, dst)
    assert client.batch_get_into_ptr([], [], []) == [] and client.batch_put_from_ptr([], [], []) == []


def test_a_full_dram_tier_spills_to_ssd_and_reads_back(make_client) -> None:
    client = make_client(dram=256 * KiB)  # 16 pages of DRAM for 64 pages
    src, dst = pages(64, PAGE, 7), np.zeros((64, PAGE), np.uint8)
    keys = [f"s{i}" for i in range(64)]
    assert all(client.batch_put_from_ptr(keys, [addr(src, i) for i in range(64)], [PAGE] * 64))
    assert client.flush()
    stats = client.stats()
    assert stats["keys"] == 64 and stats["ssd_keys"] >= 48 and stats["dram_used"] <= 256 * KiB
    assert client.batch_exists_consecutive(keys) == 64
    assert all(client.batch_get_into_ptr(keys, [addr(dst, i) for i in range(64)], [PAGE] * 64))
    assert np.array_equal(src, dst)
    one = np.zeros((1, PAGE), np.uint8)
    assert client.get_into_ptr("s0", addr(one), PAGE) and np.array_equal(one[0], src[0])


def test_an_ssd_hit_is_staged_back_into_dram(make_client) -> None:
    client = make_client(dram=64 * KiB)  # 4 pages
    src, dst = pages(8, PAGE), np.zeros((1, PAGE), np.uint8)
    for i in range(8):
        assert client.put_from_ptr(f"k{i}", addr(src, i), PAGE)
    client.flush()
    store = client._store
    assert store.lookup("k0") == (UMBPTierType.SSD, PAGE)
    assert client.get_into_ptr("k0", addr(dst), PAGE) and np.array_equal(dst[0], src[0])
    assert store.lookup("k0") == (UMBPTierType.DRAM, PAGE)


def test_without_promotion_an_ssd_hit_stays_on_ssd(tmp_path, make_client) -> None:
    cfg = small_config(tmp_path, dram=64 * KiB)
    cfg.eviction.auto_promote_on_read = False
    client = make_client(cfg)
    src, dst = pages(8, PAGE), np.zeros((8, PAGE), np.uint8)
    client.batch_put_from_ptr([f"k{i}" for i in range(8)], [addr(src, i) for i in range(8)], [PAGE] * 8)
    client.flush()
    assert all(client.batch_get_into_ptr([f"k{i}" for i in range(8)], [addr(dst, i) for i in range(8)], [PAGE] * 8))
    assert np.array_equal(src, dst)
    assert client._store.lookup("k0") == (UMBPTierType.SSD, PAGE)


def test_without_ssd_the_oldest_pages_are_dropped(make_client) -> None:
    client = make_client(dram=64 * KiB, ssd=False)
    src, dst = pages(12, PAGE), np.zeros((1, PAGE), np.uint8)
    for i in range(12):
        assert client.put_from_ptr(f"k{i}", addr(src, i), PAGE)
    assert not client.exists("k0")
    assert client.exists("k11")
    assert client.get_into_ptr("k11", addr(dst), PAGE) and np.array_equal(dst[0], src[11])
    assert client.stats()["dram_used"] <= 64 * KiB


def test_reads_keep_a_page_recent(make_client) -> None:
    client = make_client(dram=64 * KiB, ssd=False)
    src, dst = pages(4, PAGE), np.zeros((1, PAGE), np.uint8)
    for i in range(3):
        client.put_from_ptr(f"k{i}", addr(src, i), PAGE)
    client.get_into_ptr("k0", addr(dst), PAGE)  # k0 is now the most recent
    client.put_from_ptr("k3", addr(src, 3), PAGE)  # over the high watermark: the two oldest leave
    assert client.exists("k0") and client.exists("k3")
    assert not client.exists("k1") and not client.exists("k2")


def test_deeper_pages_leave_dram_first(make_client) -> None:
    client = make_client(dram=64 * KiB, ssd=False)
    src = pages(4, PAGE)
    keys = ["shallow", "deep", "mid", "deeper"]
    assert all(client.batch_put_from_ptr_with_depth(keys, [addr(src, i) for i in range(4)], [PAGE] * 4, [0, 5, 1, 9]))
    extra = pages(1, PAGE, 3)
    client.put_from_ptr("new", addr(extra), PAGE)  # over the high watermark: down to the low one
    assert client.exists("shallow") and not client.exists("deeper")


@pytest.mark.parametrize("mode", [UMBPDurabilityMode.Strict, UMBPDurabilityMode.Relaxed])
def test_durability_modes_round_trip(tmp_path, make_client, mode: UMBPDurabilityMode) -> None:
    cfg = small_config(tmp_path, dram=64 * KiB)
    cfg.ssd.durability.mode = mode
    cfg.copy_pipeline.async_enabled = False
    client = make_client(cfg)
    src, dst = pages(16, PAGE, 5), np.zeros((16, PAGE), np.uint8)
    keys = [f"d{i}" for i in range(16)]
    assert all(client.batch_put_from_ptr(keys, [addr(src, i) for i in range(16)], [PAGE] * 16))
    assert client.flush()
    assert client.stats()["ssd_keys"] >= 8
    assert all(client.batch_get_into_ptr(keys, [addr(dst, i) for i in range(16)], [PAGE] * 16))
    assert np.array_equal(src, dst)


def test_the_ssd_directory_is_the_clients_own(tmp_path, make_client) -> None:
    client = make_client(dram=64 * KiB)
    src = pages(8, PAGE)
    client.batch_put_from_ptr([f"k{i}" for i in range(8)], [addr(src, i) for i in range(8)], [PAGE] * 8)
    client.flush()
    directory = tmp_path / "ssd"
    assert any(name.startswith("umbp-seg-") for name in os.listdir(directory))
    with pytest.raises(RuntimeError, match="in use by another UMBP client"):
        UMBPClient(small_config(tmp_path))
    client.close()
    assert not any(name.startswith("umbp-seg-") for name in os.listdir(directory))
    UMBPClient(small_config(tmp_path)).close()  # free again once closed


def test_a_corrupt_ssd_record_is_a_miss_never_wrong_bytes(make_client, tmp_path) -> None:
    client = make_client(dram=64 * KiB)
    src, dst = pages(8, PAGE, 9), np.zeros((1, PAGE), np.uint8)
    client.batch_put_from_ptr([f"k{i}" for i in range(8)], [addr(src, i) for i in range(8)], [PAGE] * 8)
    client.flush()
    record = client._store._index["k0"].ssd
    assert record is not None
    path = tmp_path / "ssd" / f"umbp-seg-{record.segment:05d}"
    with open(path, "r+b") as f:
        f.seek(record.offset + 100)
        f.write(bytes([src[0, 100] ^ 0xFF]))
    assert not client.get_into_ptr("k0", addr(dst), PAGE)
    assert not dst.any()


def test_ranges(make_client) -> None:
    client = make_client()
    parts = pages(3, 4 * KiB, 11)
    total = 12 * KiB
    # the value is parts[2] | parts[0] | parts[1]
    assert client.batch_put_ranges_from_ptr(
        ["r"], [total], [[addr(parts, 0), addr(parts, 1), addr(parts, 2)]], [[4 * KiB] * 3], [[4 * KiB, 8 * KiB, 0]]
    ) == [True]
    whole = np.zeros(total, np.uint8)
    assert client.get_into_ptr("r", int(whole.ctypes.data), total)
    assert np.array_equal(whole, np.concatenate([parts[2], parts[0], parts[1]]))
    out = np.zeros((2, 100), np.uint8)
    assert client.batch_get_ranges_into_ptr(
        ["r", "r", "absent"],
        [[addr(out, 0)], [addr(out, 1)], [addr(out, 0)]],
        [[100], [100], [1]],
        [[4 * KiB + 5], [total - 100], [0]],
    ) == [True, True, False]
    assert np.array_equal(out[0], parts[0][5:105]) and np.array_equal(out[1], parts[1][-100:])
    assert client.batch_get_ranges_into_ptr(["r"], [[addr(out)]], [[100]], [[total - 50]]) == [False]
    assert client.supports_ranged_io()


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([0, 4096, 4096], "overlap"),
        ([0, 4096, 12288], "gap"),
        ([0, 4096], "differ in length"),
    ],
)
def test_ranges_that_do_not_tile_are_refused(make_client, offsets, message) -> None:
    client = make_client()
    parts = pages(3, 4 * KiB)
    with pytest.raises(ValueError, match=message):
        client.batch_put_ranges_from_ptr(
            ["r"], [12 * KiB], [[addr(parts, i) for i in range(3)]], [[4 * KiB] * 3], [offsets]
        )
    assert not client.exists("r")


def test_register_memory(make_client) -> None:
    client = make_client()
    pool = np.zeros(1 << 20, np.uint8)
    base = int(pool.ctypes.data)
    assert client.register_memory(base, pool.nbytes)
    assert client.register_memory(base, pool.nbytes)  # again: still a success
    assert client.register_memory(base + 4096, 4096)  # inside another: fine (pools round up their extents)
    assert not client.register_memory(base, 4096, MemoryLocationType.GPU, 0)
    client.deregister_memory(base)
    client.deregister_memory(base)
    assert client.register_memory(base + 4096, 4096)


def test_introspection_and_external_kv_without_a_master(make_client) -> None:
    client = make_client()
    assert client.is_distributed() and client.get_deployment_mode() == UMBPDeploymentMode.Distributed
    assert client.get_backend_mode() == UMBPDeploymentMode.Distributed
    assert client.report_external_kv_blocks(["h1"], UMBPTierType.HBM) is False
    assert client.revoke_external_kv_blocks(["h1"], UMBPTierType.DRAM) is False
    assert client.revoke_all_external_kv_blocks_at_tier(UMBPTierType.DRAM) is False
    assert client.match_external_kv(["h1"], count_as_hit=True) == []
    assert client.get_external_kv_hit_counts(["h1"]) == []
    with pytest.raises(TypeError, match="tier must be a UMBPTierType"):
        client.report_external_kv_blocks(["h1"], 2)


def test_clear_flush_close(make_client) -> None:
    client = make_client(dram=64 * KiB)
    src = pages(8, PAGE)
    client.batch_put_from_ptr([f"k{i}" for i in range(8)], [addr(src, i) for i in range(8)], [PAGE] * 8)
    assert client.flush()
    assert client.clear()
    assert client.stats() == {**client.stats(), "keys": 0, "dram_used": 0, "ssd_used": 0}
    assert not client.exists("k7")
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.put_from_ptr("k", addr(src), PAGE)


def test_context_manager_and_default_config(tmp_path) -> None:
    cfg = UMBPConfig()
    cfg.ssd.enabled = False
    cfg.dram.capacity_bytes = 1 << 20
    with UMBPClient(cfg) as client:
        src = pages(1, 4096)
        assert client.put_from_ptr("x", addr(src), 4096)
    with pytest.raises(RuntimeError):
        client.exists("x")


BAD_SINGLE = [
    (lambda c, a: c.put_from_ptr(3, a, 16), TypeError, "key must be a str"),
    (lambda c, a: c.put_from_ptr("", a, 16), ValueError, "key must not be empty"),
    (lambda c, a: c.put_from_ptr("x" * 1025, a, 16), ValueError, "the most is 1024"),
    (lambda c, a: c.put_from_ptr("a\0b", a, 16), ValueError, "NUL"),
    (lambda c, a: c.put_from_ptr("\ud800", a, 16), ValueError, "surrogate"),
    (lambda c, a: c.put_from_ptr("k", 0, 16), ValueError, "nonzero 64-bit address"),
    (lambda c, a: c.put_from_ptr("k", 1 << 64, 16), ValueError, "nonzero 64-bit address"),
    (lambda c, a: c.put_from_ptr("k", a, 0), ValueError, r"size must be in \[1, "),
    (lambda c, a: c.put_from_ptr("k", a, -5), ValueError, r"size must be in \[1, "),
    (lambda c, a: c.put_from_ptr("k", a, 1 << 40), ValueError, r"size must be in \[1, "),
    (lambda c, a: c.put_from_ptr("k", a, 16.0), TypeError, "size must be an int"),
    (lambda c, a: c.put_from_ptr("k", a, True), TypeError, "size must be an int"),
    (lambda c, a: c.get_into_ptr("k", "0x10", 16), TypeError, "dst must be an int"),
    (lambda c, a: c.batch_put_from_ptr(["a", "b"], [a], [16, 16]), ValueError, "keys=2, ptrs=1, sizes=2"),
    (lambda c, a: c.batch_put_from_ptr(["a", 5], [a, a], [16, 16]), TypeError, r"keys\[1\] must be a str"),
    (lambda c, a: c.batch_put_from_ptr("ab", [a, a], [16, 16]), TypeError, "keys must be a list"),
    (lambda c, a: c.batch_get_into_ptr(["a"], [a], [0]), ValueError, r"sizes\[0\] must be in"),
    (lambda c, a: c.batch_put_from_ptr_with_depth(["a"], [a], [16], [-2]), ValueError, r"depths\[0\]"),
    (lambda c, a: c.batch_put_from_ptr_with_depth(["a"], [a], [16], [1, 2]), ValueError, "differ in length"),
    (lambda c, a: c.batch_exists(["ok", ""]), ValueError, r"keys\[1\] must not be empty"),
    (lambda c, a: c.batch_exists(["ok", "a\0b"]), ValueError, r"keys\[1\] 'a\\x00b' contains a NUL"),
    (lambda c, a: c.batch_exists(["ok", "k\ud800"]), ValueError, r"keys\[1\] .*UTF-8 \(lone surrogate\)"),
    (lambda c, a: c.batch_exists(["ok", "é" * 513]), ValueError, r"keys\[1\] is 1026 bytes long"),
    (lambda c, a: c.batch_get_ranges_into_ptr(["a"], [[a]], [[16]], [[-1]]), ValueError, "src_offsets"),
    (lambda c, a: c.batch_get_ranges_into_ptr(["a"], [[]], [[]], [[]]), ValueError, "has no ranges"),
]


@pytest.mark.parametrize(("call", "error", "message"), BAD_SINGLE)
def test_malformed_input_is_refused_and_changes_nothing(make_client, call, error, message) -> None:
    client = make_client()
    src = pages(1, PAGE)
    client.put_from_ptr("present", addr(src), PAGE)
    before = client.stats()
    with pytest.raises(error, match=message):
        call(client, addr(src))
    assert client.stats() == before
    assert client.batch_exists(["a", "b", "k"]) == [False] * 3


def test_a_value_larger_than_an_ssd_segment_is_refused(tmp_path, make_client) -> None:
    client = make_client(dram=4 << 20, segment=256 * KiB)
    assert client.max_value_size == 256 * KiB
    src = pages(1, 512 * KiB)
    with pytest.raises(ValueError, match=r"size must be in \[1, 262144\]"):
        client.put_from_ptr("big", addr(src), 512 * KiB)


def test_threads_put_and_get_at_once(make_client) -> None:
    client = make_client(dram=128 * KiB)
    src = pages(4 * 24, 8 * KiB, 21)
    errors: list[str] = []

    def worker(t: int) -> None:
        dst = np.zeros((1, 8 * KiB), np.uint8)
        rows = range(t * 24, (t + 1) * 24)
        for i in rows:
            if not client.put_from_ptr(f"t{i}", addr(src, i), 8 * KiB):
                errors.append(f"put t{i}")
        for i in rows:
            if not client.get_into_ptr(f"t{i}", addr(dst), 8 * KiB) or not np.array_equal(dst[0], src[i]):
                errors.append(f"get t{i}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []


ODD_KEYS = ["", "\0", "a\0", "x" * 1024, "x" * 1025, "é" * 512, "é" * 513, "\ud800", b"k", 7, None]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(ODD_KEYS)), max_size=6))
def test_a_batch_s_keys_are_checked_as_each_key_is(keys):
    """check_keys checks a batch of plain keys whole; its answer is check_key's for each key."""

    def outcome(check):
        try:
            return check()
        except (TypeError, ValueError) as e:
            return type(e), str(e)

    per_key = outcome(lambda: [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)])
    assert outcome(lambda: check_keys(keys)) == per_key
