"""Random sequences of puts, gets, ranges, evictions and clears against a dict: a pool of a few
pages of DRAM and SSD may drop a key (it is a cache), but what it returns is always the bytes
that key was put with, and a key it says it has it returns. Also the extent allocator alone."""

from __future__ import annotations

import numpy as np
from _pool import KiB, small_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.umbp import UMBPClient
from mori.umbp._extents import ALIGN, ExtentAllocator

SIZES = [1, 100, 4 * KiB, 4 * KiB + 1, 12 * KiB, 30 * KiB]
KEYS = [f"k{i}" for i in range(24)]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from(KEYS), st.sampled_from(SIZES), st.integers(-1, 5)),
        st.tuples(st.just("get"), st.sampled_from(KEYS)),
        st.tuples(st.just("range"), st.sampled_from(KEYS), st.integers(0, 40 * KiB), st.integers(1, 300)),
        st.tuples(st.just("exists"), st.lists(st.sampled_from(KEYS), max_size=6)),
        st.tuples(st.just("flush")),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(script=ops, ssd=st.booleans(), promote=st.booleans())
def test_the_pool_never_returns_other_bytes(tmp_path_factory, script, ssd: bool, promote: bool) -> None:
    cfg = small_config(
        tmp_path_factory.mktemp("model"), dram=64 * KiB, ssd=ssd, ssd_capacity=256 * KiB, segment=64 * KiB
    )
    cfg.eviction.auto_promote_on_read = promote
    rng = np.random.default_rng(len(script))
    model: dict[str, np.ndarray] = {}
    keep: list[np.ndarray] = []
    with UMBPClient(cfg) as client:
        for op in script:
            if op[0] == "put":
                _, key, size, depth = op
                data = rng.integers(0, 256, size, dtype=np.uint8)
                keep.append(data)
                ok = client.batch_put_from_ptr_with_depth([key], [int(data.ctypes.data)], [size], [depth])[0]
                if ok and key not in model and client.exists(key):
                    model[key] = data
            elif op[0] == "get":
                key = op[1]
                size = len(model[key]) if key in model else 4 * KiB
                out = np.zeros(size, np.uint8)
                if client.get_into_ptr(key, int(out.ctypes.data), size):
                    assert key in model and np.array_equal(out, model[key])
                else:
                    assert not client.exists(key) or key not in model
                    assert not out.any()
            elif op[0] == "range":
                _, key, offset, length = op
                out = np.zeros(length, np.uint8)
                got = client.batch_get_ranges_into_ptr([key], [[int(out.ctypes.data)]], [[length]], [[offset]])[0]
                if got:
                    assert np.array_equal(out, model[key][offset : offset + length])
                else:
                    assert key not in model or offset + length > len(model[key]) or not client.exists(key)
            elif op[0] == "exists":
                found = client.batch_exists(op[1])
                assert all(key in model for key, hit in zip(op[1], found) if hit)
            elif op[0] == "flush":
                assert client.flush()
            else:
                assert client.clear()
                model.clear()
            for key in list(model):  # a cache may drop what it holds: forget what it no longer has
                if not client.exists(key):
                    del model[key]
        stats = client.stats()
        assert stats["dram_used"] <= stats["dram_capacity"] and stats["ssd_used"] <= stats["ssd_capacity"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5 * ALIGN)), max_size=80))
def test_extents_never_overlap_and_all_come_back(steps) -> None:
    allocator = ExtentAllocator(32 * ALIGN)
    live: list[tuple[int, int]] = []
    for take, size in steps:
        if take or not live:
            offset = allocator.allocate(size)
            if offset is None:
                assert allocator.largest_free() < size
                continue
            assert offset % ALIGN == 0 and offset + size <= allocator.capacity
            for start, length in live:
                assert offset + size <= start or start + length <= offset
            live.append((offset, size))
        else:
            allocator.free(*live.pop(len(live) // 2))
    for extent in live:
        allocator.free(*extent)
    assert allocator.used == 0 and allocator.largest_free() == allocator.capacity
