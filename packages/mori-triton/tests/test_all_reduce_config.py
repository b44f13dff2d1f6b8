"""The size -> configuration table of all_reduce and the configurations the benchmark sweeps (no GPU needed)."""

from __future__ import annotations

import pytest

from mori.triton._all_reduce import (
    DEFAULT_TABLE,
    SWEEP_LARGE,
    SWEEP_SMALL,
    AllReduceConfig,
    all_reduce_sweep,
    default_all_reduce_config,
)


def test_table_rows_grow_and_cover_every_size():
    limits = [limit for limit, _ in DEFAULT_TABLE]
    assert limits == sorted(limits) and limits[-1] >= 64 << 20
    for size in (1, 8 << 10, 64 * 7168 * 2, 64 << 20):
        cfg = default_all_reduce_config(size, 4)
        assert cfg == next(c for limit, c in DEFAULT_TABLE if size <= limit)


def test_sweep_holds_every_kernel_and_the_defaults():
    for size in (8 << 10, 64 * 7168 * 2, 2 << 20, 64 << 20):
        configs = all_reduce_sweep(size)
        kernels = {"v2", "v3"} if size <= 2 << 20 else {"v2"}  # v3 has slots up to a few MiB
        assert {c.kernel for c in configs} == kernels and len(set(configs)) == len(configs)
        assert default_all_reduce_config(size, 4) in configs, f"the default at {size} bytes is not benchmarked"
    assert set(all_reduce_sweep(2 << 20)) == set(SWEEP_SMALL) | set(SWEEP_LARGE)


def test_labels_name_every_field():
    assert AllReduceConfig(False, 4096, 8, 132).label == "2shot-v2 b4096 w8 g132"
    assert AllReduceConfig(True, 2048, 8, 64, "v3").label == "1shot-v3 b2048 w8 g64"


@pytest.mark.parametrize(
    "args,match",
    [
        ((True, 1024, 4, 64, "v4"), "kernel"),
        ((True, 1024, 4, 64, "v1"), "kernel"),
        ((True, 1000, 4, 64), "block"),
        ((True, 1024, 3, 64), "num_warps"),
        ((True, 1024, 4, 0), "max_blocks"),
        ((True, 1024, 4, 4096), "max_blocks"),
    ],
)
def test_bad_configs_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        AllReduceConfig(*args)
