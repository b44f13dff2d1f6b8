"""Helpers of the tests: small pools (a DRAM tier of a few pages, an SSD tier in the test's own
directory) and page buffers in host memory with their addresses."""

from __future__ import annotations

import numpy as np

from mori.umbp import UMBPConfig

KiB = 1 << 10


def small_config(
    tmp_path, dram: int = 256 * KiB, ssd: bool = True, ssd_capacity: int = 8 << 20, segment: int = 1 << 20
) -> UMBPConfig:
    """A pool of ``dram`` bytes of DRAM and, with ``ssd``, an SSD tier under ``tmp_path``."""
    cfg = UMBPConfig()
    cfg.dram.capacity_bytes = dram
    cfg.dram.prefault = False
    cfg.ssd.enabled = ssd
    cfg.ssd.storage_dir = str(tmp_path / "ssd")
    cfg.ssd.capacity_bytes = ssd_capacity
    cfg.ssd.segment_size_bytes = segment
    return cfg


def pages(count: int, size: int, seed: int = 0) -> np.ndarray:
    """``count`` pages of ``size`` random bytes, one per row."""
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def addr(array: np.ndarray, row: int = 0) -> int:
    """The address of a row of a page array."""
    return int(array.ctypes.data) + row * array.shape[1]
