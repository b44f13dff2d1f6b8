"""SGLang 0.5.23's ``UMBPStore`` (HiCache's storage backend ``mori``) replayed on one node: its
configuration from ``extra_config``, ``register_memory`` of the host KV pool, ``batch_set_v1``
of page keys (with prefix depths), ``batch_exists``, ``batch_get_v1`` into other pages of the
pool after the first ones were overwritten, the KV-events subscriber's external-KV report and
revoke, and teardown; every byte of every page checked. The DRAM tier holds a quarter of the
pages, so most of them go to SSD and come back from there. Then the standalone-process mode
(``UMBP_STANDALONE_ADDRESS``): two ranks' shared host pools, one server for both.

Source replayed: ``python/sglang/srt/mem_cache/storage/umbp/umbp_store.py`` (``UMBPStore``:
``__init__``, ``register_mem_pool_host``, ``_register_host_buffer_for_zero_copy``,
``_batch_preprocess``, ``batch_set_v1``, ``batch_get_v1``, ``batch_exists``, ``close``;
``KVEventsSubscriber.on_event``), re-created in :mod:`_sglang_umbp`.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _sglang_umbp import HostKVPool, StorageConfig, UmbpStoreReplay

from mori.umbp import UMBPDeploymentMode, UMBPDurabilityMode, UMBPIoBackend

PAGES = 64
CHUNK = 16  # pages per batch_set_v1, as HiCache backs up a request's pages in chunks


def _extra(tmp_path, dram: int) -> dict:
    return {
        "dram_capacity_bytes": dram,
        "ssd_enabled": "true",
        "ssd_storage_dir": str(tmp_path / "hicache"),
        "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_size_bytes": 8 << 20,
        "ssd_durability_mode": "relaxed",
        "ssd_io_backend": "posix",
        "ssd_copy_worker_threads": 2,
        "eviction_candidate_window": 8,
        "auto_promote_on_read": "1",
        "ssd_high_watermark": 0.9,
        "ssd_low_watermark": 0.7,
    }


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_umbp_store_replay_one_node(tmp_path, mla: bool) -> None:
    pool = HostKVPool(pages=2 * PAGES, page_size=16, layers=4, heads=2, head_dim=64, mla=mla)
    page_bytes = len(pool.page_bytes(0))
    storage = StorageConfig(is_mla_model=mla, extra_config=_extra(tmp_path, dram=PAGES * page_bytes // 4))
    store = UmbpStoreReplay(storage, pool)

    cfg = store.config
    assert (cfg.dram.capacity_bytes, cfg.ssd.enabled, cfg.ssd.io.backend) == (
        PAGES * page_bytes // 4,
        True,
        UMBPIoBackend.Posix,
    )
    assert cfg.ssd.durability.mode == UMBPDurabilityMode.Relaxed
    assert store.registered == [(int(pool.kv_buffer.ctypes.data), pool.kv_buffer.nbytes)]

    rng = np.random.default_rng(41)
    pool.kv_buffer[...] = rng.integers(0, 256, pool.kv_buffer.shape, dtype=np.uint8)
    expected = [pool.page_bytes(p) for p in range(PAGES)]
    keys = [f"{rng.integers(1 << 62):016x}" for _ in range(PAGES)]
    for start in range(0, PAGES, CHUNK):
        indices = np.arange(start * pool.page_size, (start + CHUNK) * pool.page_size)
        prefix = keys[:start] if start else None
        assert store.batch_set_v1(keys[start : start + CHUNK], indices, prefix) == [True] * CHUNK
    assert store.batch_set_v1(keys[:CHUNK], np.arange(CHUNK * pool.page_size), None) == [True] * CHUNK

    # The host pool's pages are reused for other requests; the prefix hits again later.
    pool.kv_buffer[...] = 0
    assert store.batch_exists(keys) == PAGES
    assert store.batch_exists(keys[:5] + ["f" * 16] + keys[5:]) == 5
    stats = store.client.stats()
    assert stats["ssd_keys"] > 0 and stats["dram_used"] <= cfg.dram.capacity_bytes

    # Read back into the pool's second half, in the chunks HiCache prefetches.
    for start in range(0, PAGES, CHUNK):
        first = PAGES + start
        indices = np.arange(first * pool.page_size, (first + CHUNK) * pool.page_size)
        assert store.batch_get_v1(keys[start : start + CHUNK], indices) == [True] * CHUNK
    for page in range(PAGES):
        assert pool.page_bytes(PAGES + page) == expected[page], f"page {page} differs"
    zero_page = bytes(page_bytes)
    assert all(pool.page_bytes(page) == zero_page for page in range(PAGES))
    assert store.batch_get_v1(["0" * 16], np.arange(pool.page_size)) == [False]  # a miss writes nothing
    assert pool.page_bytes(0) == zero_page

    # KV events: with no master there is no external-KV index to report to.
    assert store.on_block_stored([11, 12], "GPU") is False
    assert store.on_block_removed([11], "GPU") is False
    assert store.on_all_blocks_cleared() == (False, False)

    assert store.close()
    assert not any(name.startswith("umbp-seg-") for name in os.listdir(tmp_path / "hicache"))


def test_umbp_store_replay_standalone_process_mla_ranks_share_pages(tmp_path, monkeypatch) -> None:
    """Standalone-process mode as SGLang runs it with ``UMBP_STANDALONE_ADDRESS``: the host pools
    in shared memory (UMBPHostTensorAllocator), the first rank's client starting the server, and
    two MLA ranks of one model, whose page keys are the same on every rank, sharing one pool: the
    second finds and reads what the first backed up."""
    for name, value in {
        "UMBP_STANDALONE_ADDRESS": f"unix://{tmp_path}/umbp.sock",
        "UMBP_STANDALONE_AUTO_START": "true",
        "UMBP_DRAM_CAPACITY": str(512 << 10),
        "UMBP_DRAM_PREFAULT": "0",
        "UMBP_SSD_DIR": str(tmp_path / "ssd"),
        "UMBP_SSD_CAPACITY": str(64 << 20),
    }.items():
        monkeypatch.setenv(name, value)
    pools = [
        HostKVPool(pages=2 * PAGES, page_size=16, layers=4, heads=1, head_dim=64, mla=True, shared=True)
        for _ in range(2)
    ]
    ranks = [UmbpStoreReplay(StorageConfig(tp_rank=r, tp_size=2, is_mla_model=True), pools[r]) for r in range(2)]
    try:
        for rank, pool in zip(ranks, pools):
            assert rank.client.get_deployment_mode() == UMBPDeploymentMode.StandaloneProcess
            assert rank.registered == [(int(pool.kv_buffer.ctypes.data), pool.kv_buffer.nbytes)]
        pools[0].kv_buffer[...] = np.random.default_rng(7).integers(0, 256, pools[0].kv_buffer.shape, dtype=np.uint8)
        expected = [pools[0].page_bytes(p) for p in range(PAGES)]
        keys = [f"{p:016x}" for p in range(PAGES)]
        assert ranks[0].batch_set_v1(keys, np.arange(PAGES * 16), None) == [True] * PAGES
        assert ranks[1].batch_exists(keys) == PAGES
        assert ranks[1].batch_get_v1(keys, np.arange(PAGES * 16, 2 * PAGES * 16)) == [True] * PAGES
        assert all(pools[1].page_bytes(PAGES + p) == expected[p] for p in range(PAGES))
    finally:
        for rank in reversed(ranks):  # the first rank's client started the server: it stops it
            rank.close()
        for pool in pools:
            pool.free()
