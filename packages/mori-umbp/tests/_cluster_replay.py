"""The processes of the cluster replay, each a mori.core.testing command process (in a network
namespace of its own, or here): the master (with its Redis server when asked) and SGLang ranks,
each an :class:`_sglang_umbp.UmbpStoreReplay` over a host KV pool of its own."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import numpy as np
from _cluster_nodes import FAST_MASTER
from _master_harness import MasterProcess, redis_server
from _sglang_umbp import HostKVPool, StorageConfig, UmbpStoreReplay

from mori.core.testing import serve_commands

POOL = {"pages": 96, "page_size": 16, "layers": 4, "heads": 2, "head_dim": 64}


def master_host(listen_ip: str, redis: bool, workdir: str) -> str:
    """Starts Redis (when asked) and the master on ``listen_ip``; serves ``address``, ``restart``
    (the master killed and started again on the same address) and ``close``."""
    stack = contextlib.ExitStack()
    env = dict(FAST_MASTER)
    if redis:
        uri = stack.enter_context(redis_server(Path(workdir)))
        env.update(UMBP_METADATA_BACKEND="redis", UMBP_REDIS_URI=uri)
    masters = [MasterProcess(env, listen=f"{listen_ip}:0").start()]
    stack.callback(lambda: masters[-1].kill())

    def restart() -> str:
        masters[-1].kill()
        masters.append(MasterProcess(env, listen=masters[0].address).start())
        return masters[-1].address

    serve_commands({"restart": restart, "close": stack.close}, stack)
    return masters[0].address


def seeded_pool(seed: int) -> HostKVPool:
    pool = HostKVPool(**POOL)  # type: ignore[arg-type]
    pool.kv_buffer[...] = np.random.default_rng(seed).integers(0, 256, pool.kv_buffer.shape, dtype=np.uint8)
    return pool


def sglang_rank(extra: dict[str, Any]) -> dict[str, Any]:
    """An SGLang rank: ``UMBPStore`` over a host pool. Serves ``put(seed, keys)`` (the pool's
    first pages filled from ``seed`` and backed up), ``exists(keys)``, ``get(seed, keys)`` (read
    into the pool's last pages; per page whether it holds what ``seed`` made), ``stored``,
    ``revoke_all`` and ``close``; returns what the configuration became."""
    pool = HostKVPool(**POOL)  # type: ignore[arg-type]
    store = UmbpStoreReplay(StorageConfig(extra_config=extra), pool)

    def put(seed: int, keys: list[str]) -> list[bool]:
        filled = seeded_pool(seed)
        pool.kv_buffer[...] = filled.kv_buffer
        n = len(keys)
        return store.batch_set_v1(keys, np.arange(n * pool.page_size), None)

    def get(seed: int, keys: list[str]) -> list[bool]:
        expected = seeded_pool(seed)
        first = POOL["pages"] - len(keys)
        pool.kv_buffer[...] = 0
        got = store.batch_get_v1(keys, np.arange(first * pool.page_size, POOL["pages"] * pool.page_size))
        return [ok and pool.page_bytes(first + i) == expected.page_bytes(i) for i, ok in enumerate(got)]

    serve_commands(
        {
            "put": put,
            "get": get,
            "exists": store.batch_exists,
            "stored": lambda hashes: store.on_block_stored(hashes, "GPU"),
            "removed": lambda hashes: store.on_block_removed(hashes, "GPU"),
            "cleared": store.on_all_blocks_cleared,
            "match": lambda hashes: sorted(m.node_id for m in store.client.match_external_kv([str(h) for h in hashes])),
            "keys_here": lambda: store.client.stats()["keys"],
            "close": store.close,
        },
        pool,
        store,
    )
    dist = store.config.distributed
    return {
        "registered": store.registered,
        "node_id": dist.master_config.node_id,
        "dram_page_size": dist.dram_page_size,
        "mode": int(store.client.get_deployment_mode()),
    }
