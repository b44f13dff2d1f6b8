"""mori-core's GPU staging (``mori.core.staging``, C++ ``csrc/gpu/``) run on the host stand-in of
the driver (``mori.core.testing.standin_stager``): lending, reuse, the cache bound, pinning that
fails, copies that fail or never end, and close. The same code runs on a GPU in
``ci/device/core.sh``."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from mori.core import staging, testing

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _knobs_reset():
    testing.standin_knobs()
    yield
    testing.standin_knobs()


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_the_public_names_are_the_native_ones():
    stager = testing.standin_stager()
    assert isinstance(stager, staging.Stager)
    assert (
        "cuMemcpyDtoHAsync" in staging.STAGING_ENTRY_POINTS and "cuStreamWriteValue32" in staging.STAGING_ENTRY_POINTS
    )
    assert stager.cache_bytes == staging.STAGING_CACHE_BYTES


@pytest.mark.parametrize("size", [1, 4096, 64 << 10, 3 * MiB + 7])
def test_bytes_go_out_and_in_unchanged(size):
    stager = testing.standin_stager()
    src, dst = _bytes(size, size), np.zeros(size, dtype=np.uint8)
    out = stager.to_host(int(src.ctypes.data), size)
    assert out.pinned and out.size == size and out.copied()
    landing = stager.landing(size)
    np.copyto(
        np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * size).from_address(landing.address), dtype=np.uint8),
        np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * size).from_address(out.address), dtype=np.uint8),
    )
    stager.to_device(int(dst.ctypes.data), landing, wait=False)
    landing.wait()
    assert np.array_equal(src, dst)


def test_memory_is_lent_by_capacity_and_reused():
    stager = testing.standin_stager()
    before = testing.standin_counters()["allocations"]
    for _ in range(5):
        stager.landing(100 << 10).release()  # a 128 KiB capacity each time
    stats = stager.stats()
    assert stats["pinned"] == 1 and stats["reused"] == 4 and stats["lent"] == 0
    assert stats["cached_bytes"] == 128 << 10
    assert testing.standin_counters()["allocations"] - before == 1
    held = [stager.landing(100 << 10) for _ in range(3)]  # three at once: two more allocations
    assert stager.stats()["lent"] == 3 and stager.stats()["pinned"] == 3
    for h in held:
        h.release()
    assert stager.stats()["lent"] == 0


def test_the_pool_keeps_no_more_than_its_cache_bound():
    stager = testing.standin_stager(cache_bytes=1 * MiB)
    held = [stager.landing(MiB // 2) for _ in range(4)]
    frees = testing.standin_counters()["frees"]
    for h in held:
        h.release()
    stats = stager.stats()
    assert stats["cached_bytes"] == 1 * MiB and stats["freed"] == 2
    assert testing.standin_counters()["frees"] - frees == 2
    zero = testing.standin_stager(cache_bytes=0)
    zero.landing(4096).release()
    assert zero.stats()["cached_bytes"] == 0 and zero.stats()["freed"] == 1


def test_pinning_that_fails_falls_back_to_heap_memory_and_still_copies():
    stager = testing.standin_stager()
    testing.standin_knobs(fail_pinning=True)
    src, dst = _bytes(200 << 10, 1), np.zeros(200 << 10, dtype=np.uint8)
    out = stager.to_host(int(src.ctypes.data), src.size, wait=False)
    assert not out.pinned and out.copied()  # heap memory is copied through at once
    stager.to_device(int(dst.ctypes.data), out, wait=False)
    assert np.array_equal(src, dst)
    assert stager.stats()["unpinned"] == 1 and stager.stats()["lent"] == 0


def test_a_failed_copy_raises_naming_the_driver_call_and_lends_nothing_more():
    stager = testing.standin_stager()
    src = _bytes(4096, 2)
    testing.standin_knobs(fail_copy_in=0)
    with pytest.raises(RuntimeError, match=r"cuMemcpyDtoHAsync failed on the GPU \(CUresult 999\)"):
        stager.to_host(int(src.ctypes.data), 4096)
    assert stager.stats()["lent"] == 0  # the memory went back
    testing.standin_knobs()
    assert stager.to_host(int(src.ctypes.data), 4096).copied()  # a failed copy does not break the stager


def test_a_copy_that_never_ends_times_out_and_its_memory_is_never_lent_again():
    stager = testing.standin_stager(timeout=0.3)
    src = _bytes(4096, 3)
    testing.standin_knobs(hang=True)
    out = stager.to_host(int(src.ctypes.data), 4096, wait=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not finish on the GPU within 0.3 s \(timeout\)"):
        out.wait()
    assert 0.25 < time.monotonic() - started < 5
    out.release()
    stats = stager.stats()
    assert stats["abandoned"] == 1 and stats["lent"] == 0 and stats["cached_bytes"] == 0


def test_a_copy_that_fails_on_the_device_raises_long_before_the_timeout_and_gives_its_memory_back():
    stager = testing.standin_stager(timeout=30.0)
    src = _bytes(4096, 6)
    testing.standin_knobs(fail_later=True)
    out = stager.to_host(int(src.ctypes.data), 4096, wait=False)
    started = time.monotonic()
    with pytest.raises(
        RuntimeError, match=r"a copy of staged bytes \(cuStreamQuery\) failed on the GPU \(CUresult 999\)"
    ):
        out.wait()
    assert time.monotonic() - started < 5  # the stream was asked after a millisecond, not after 30 s
    testing.standin_knobs()
    out.release()
    stats = stager.stats()
    assert stats["lent"] == 0 and stats["abandoned"] == 0  # the copy runs no more: its memory is kept


def test_a_delayed_copy_is_polled_until_it_ends():
    stager = testing.standin_stager()
    testing.standin_knobs(delay=0.05)
    src = _bytes(4096, 4)
    out = stager.to_host(int(src.ctypes.data), 4096, wait=False)
    assert not out.copied()
    out.wait()
    assert out.copied()


def test_a_store_behind_a_copy_lands_after_its_bytes_and_ends_with_it():
    """to_device_then_store: the signal after its data. With the copy's end delayed, the word is
    still unwritten while the staged memory says the copy runs, and both are in once it ended."""
    stager = testing.standin_stager()
    testing.standin_knobs(delay=0.05)
    data, dst = _bytes(13, 13), np.zeros(16, dtype=np.uint8)
    word = np.zeros(2, dtype=np.uint64)
    landing = stager.landing(13)
    ctypes_view = (np.ctypeslib.as_ctypes_type(np.uint8) * 13).from_address(landing.address)
    np.copyto(np.frombuffer(ctypes_view, dtype=np.uint8), data)
    stager.to_device_then_store(
        int(dst.ctypes.data), landing, int(word.ctypes.data) + 8, 0xFEEDFACE12345678, wait=False
    )
    assert not landing.copied() and word[1] == 0
    landing.wait()
    assert word[1] == 0xFEEDFACE12345678 and word[0] == 0
    assert np.array_equal(dst[:13], data) and not dst[13:].any()


def test_a_store_with_no_bytes_is_waited_for_and_a_misaligned_word_is_refused():
    stager = testing.standin_stager()
    testing.standin_knobs(delay=0.02)
    word = np.zeros(2, dtype=np.uint64)
    stager.to_device_then_store(0, stager.landing(0), int(word.ctypes.data), 7, wait=False)
    assert word[0] == 7  # (no bytes: waited for all the same)
    with pytest.raises(ValueError, match="8-byte aligned"):
        stager.to_device_then_store(0, stager.landing(0), int(word.ctypes.data) + 4, 9)
    assert word[0] == 7 and word[1] == 0


def test_close_waits_for_memory_still_lent_then_refuses_new_loans():
    stager = testing.standin_stager(timeout=5.0)
    held = stager.landing(4096)
    threading.Timer(0.2, held.release).start()
    started = time.monotonic()
    stager.close()
    assert time.monotonic() - started >= 0.15
    assert stager.stats()["lent"] == 0 and stager.stats()["cached_bytes"] == 0
    late = stager.landing(4096)  # a closed pool lends no pinned memory
    assert not late.pinned


def test_device_stager_checks_its_settings_before_touching_cuda():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        staging.device_stager(0, timeout=0)
    with pytest.raises(ValueError, match="cache_bytes must be an int >= 0"):
        staging.device_stager(0, cache_bytes=-1)


def test_the_profile_counts_each_copy_its_bytes_and_the_time_callers_waited():
    stager = testing.standin_stager()
    testing.standin_knobs(delay=0.05)
    src, dst = _bytes(4096, 5), np.zeros(4096, dtype=np.uint8)
    waited = 0

    def wait() -> None:
        nonlocal waited
        start = time.monotonic_ns()
        out.wait()
        waited += time.monotonic_ns() - start

    out = stager.to_host(int(src.ctypes.data), 4096, wait=False)
    wait()
    stager.to_device(int(dst.ctypes.data), out, wait=False)
    wait()
    stats = stager.stats()
    assert (stats["to_host"], stats["to_host_bytes"], stats["to_device"], stats["to_device_bytes"]) == (
        1,
        4096,
        1,
        4096,
    )
    # Each copy ends 50 ms after it was queued (the stand-in's delay), however slowly this thread
    # runs; the time waited is the callers' (how much of the 50 ms is left depends on the scheduler).
    assert stats["copy_ns"] >= 2 * 50_000_000 and 0 < stats["wait_ns"] <= waited
    assert np.array_equal(src, dst)


def test_MORI_STAGING_PROFILE_appends_a_line_per_stager_at_exit(tmp_path):
    profile = tmp_path / "profile.jsonl"
    script = (
        "import numpy as np\n"
        "from mori.core import staging, testing\n"
        "staging._make = lambda *args: testing.standin_stager()  # no GPU here: the stand-in's Stager\n"
        "src = np.arange(4096, dtype=np.uint8)\n"
        "staging.device_stager(0).to_host(int(src.ctypes.data), 4096)\n"
    )
    env = {**os.environ, "MORI_STAGING_PROFILE": str(profile)}
    for _ in range(2):  # appended, not overwritten
        subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    lines = [json.loads(line) for line in profile.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["pid"] != lines[1]["pid"]
    assert all(p["device"] == 0 and p["to_host"] == 1 and p["to_host_bytes"] == 4096 for p in lines)


def _slots(region: np.ndarray, size: int, order: list[int]) -> list[tuple[int, int]]:
    """Ranges of ``size`` bytes at these slots of ``region`` (device memory on the stand-in)."""
    return [(int(region.ctypes.data) + i * size, size) for i in order]


def _view(staged, n: int) -> np.ndarray:
    return np.frombuffer((np.ctypeslib.as_ctypes_type(np.uint8) * n).from_address(staged.address), dtype=np.uint8)


def test_scattered_ranges_go_out_and_in_as_one_copy_in_one_batch_call():
    """Pages scattered in device memory are gathered into staged memory back to back, and
    scattered back, each way one copy (one completion, one batch call); pages that continue one
    another in device memory are copied as one."""
    stager = testing.standin_stager()
    size, order = 16 << 10, [7, 2, 3, 11, 0, 9, 4]  # 2, 3 continue one another
    src, dst = _bytes(12 * size, 3), np.zeros(12 * size, dtype=np.uint8)
    before, counted = testing.standin_counters(), stager.stats()
    out = stager.gather_to_host(_slots(src, size, order))
    assert out.size == len(order) * size
    assert np.array_equal(_view(out, out.size), np.concatenate([src[i * size : (i + 1) * size] for i in order]))
    landing = stager.landing(out.size)
    _view(landing, out.size)[:] = _view(out, out.size)
    stager.scatter_to_device(_slots(dst, size, order), landing, wait=False)
    landing.wait()
    for i in range(12):
        want = src[i * size : (i + 1) * size] if i in order else np.zeros(size, dtype=np.uint8)
        assert np.array_equal(dst[i * size : (i + 1) * size], want), f"slot {i}"
    after, stats = testing.standin_counters(), stager.stats()
    assert after["batches"] - before["batches"] == 2 and after["copies"] - before["copies"] == 2
    assert stats["to_host"] - counted["to_host"] == 1 and stats["to_device"] - counted["to_device"] == 1
    assert stats["to_host_bytes"] - counted["to_host_bytes"] == len(order) * size


def test_ranges_back_to_back_in_device_memory_are_one_plain_copy():
    stager = testing.standin_stager()
    src = _bytes(4 * 4096, 4)
    before = testing.standin_counters()
    out = stager.gather_to_host(_slots(src, 4096, [0, 1, 2, 3]))
    assert np.array_equal(_view(out, out.size), src)
    after = testing.standin_counters()
    assert after["copies"] - before["copies"] == 1 and after["batches"] == before["batches"]


def test_a_driver_that_refuses_the_batch_call_gets_one_call_per_range(capfd):
    """A driver without cuMemcpyBatchAsync (or refusing it) still moves every byte: the copies go
    one call each, from then on without asking again, and the log says so once."""
    stager = testing.standin_stager()
    size, order = 4096, [5, 1, 3]
    src, dst = _bytes(6 * size, 5), np.zeros(6 * size, dtype=np.uint8)
    testing.standin_knobs(refuse_batch=True)
    for _ in range(2):
        before = testing.standin_counters()
        out = stager.gather_to_host(_slots(src, size, order))
        stager.scatter_to_device(_slots(dst, size, order), out)
        after = testing.standin_counters()
        assert after["copies"] - before["copies"] == 2 * len(order) and after["batches"] == before["batches"]
        for i in order:
            assert np.array_equal(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])
    assert capfd.readouterr().err.count("refuses cuMemcpyBatchAsync") == 1


def test_a_failed_batch_call_raises_naming_it_and_lends_nothing_more():
    stager = testing.standin_stager()
    src = _bytes(8 * 4096, 6)
    testing.standin_knobs(fail_copy_in=0)
    with pytest.raises(RuntimeError, match=r"cuMemcpyBatchAsync failed on the GPU \(CUresult 999\)"):
        stager.gather_to_host(_slots(src, 4096, [3, 0, 6]))
    assert stager.stats()["lent"] == 0
    testing.standin_knobs()
    assert stager.gather_to_host(_slots(src, 4096, [3, 0, 6])).copied()


def test_ranges_the_staged_bytes_do_not_fill_are_refused_before_any_copy():
    stager = testing.standin_stager()
    dst = np.zeros(3 * 4096, dtype=np.uint8)
    staged = stager.landing(8192)
    before = testing.standin_counters()
    with pytest.raises(ValueError, match="ranges that the staged bytes fill"):
        stager.scatter_to_device(_slots(dst, 4096, [2, 0, 1]), staged)
    with pytest.raises(ValueError, match="ranges that the staged bytes fill"):
        stager.scatter_to_device([], staged)
    with pytest.raises(ValueError, match="needs a range"):
        stager.gather_to_host([])
    assert testing.standin_counters()["copies"] == before["copies"] and not dst.any()


def test_scattered_ranges_through_heap_memory_when_pinning_fails():
    stager = testing.standin_stager()
    testing.standin_knobs(fail_pinning=True)
    size, order = 4096, [2, 0]
    src, dst = _bytes(3 * size, 7), np.zeros(3 * size, dtype=np.uint8)
    out = stager.gather_to_host(_slots(src, size, order), wait=False)
    assert not out.pinned and out.copied()
    stager.scatter_to_device(_slots(dst, size, order), out, wait=False)
    for i in order:
        assert np.array_equal(dst[i * size : (i + 1) * size], src[i * size : (i + 1) * size])


def test_a_thread_with_the_context_current_pushes_none():
    # An application's thread with the context current (PyTorch's, on the primary context) only
    # has its capture mode exchanged around a staging call; another thread has it pushed too.
    stager = testing.standin_stager()
    src = np.arange(4096, dtype=np.uint8)
    pushes: list[int] = []

    def stage(current: bool) -> None:
        if current:
            testing.standin_make_current()
        before = testing.standin_counters()["pushes"]
        staged = stager.to_host(int(src.ctypes.data), src.nbytes)
        assert bytes((ctypes.c_uint8 * src.nbytes).from_address(staged.address)) == src.tobytes()
        staged.release()
        pushes.append(testing.standin_counters()["pushes"] - before)

    for current in (False, True):
        t = threading.Thread(target=stage, args=(current,))
        t.start()
        t.join()
    assert pushes[0] >= 1 and pushes[1] == 0  # (the first may push for an allocation of pinned memory too)
