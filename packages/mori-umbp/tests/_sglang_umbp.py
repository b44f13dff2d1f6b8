"""SGLang 0.5.23's HiCache storage backend ``mori`` (``python/sglang/srt/mem_cache/storage/umbp/
umbp_store.py``, ``UMBPStore``), re-created call for call without importing sglang: its
configuration from ``extra_config``, the host KV pool it registers, its page keys and the client
calls of ``batch_set_v1``, ``batch_exists``, ``batch_get_v1``, ``close`` and the KV-events
subscriber's external-KV report and revoke.

Only the paths a one-model, one-rank store takes are here: MHA (a K and a V key per page) and MLA
(one key per page), the ``page_first`` layout of SGLang's ``HostKVCache``, no split heads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import mori.umbp as umbp_mod


def strict_bool(value: Any, key: str) -> bool:
    """``_strict_bool``: a bool, 0/1, or one of the true/false words."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        norm = value.strip().lower()
        if norm in ("1", "true", "yes", "on"):
            return True
        if norm in ("0", "false", "no", "off"):
            return False
    raise ValueError(f"extra_config[{key!r}] must be a boolean-like value, got {value!r}")


@dataclass
class StorageConfig:
    """The fields of SGLang's ``HiCacheStorageConfig`` that ``UMBPStore`` reads."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla_model: bool = False
    model_name: str | None = "org/model"
    should_split_heads: bool = False
    extra_config: dict[str, Any] = field(default_factory=dict)


class HostKVPool:
    """SGLang's ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` in the ``page_first`` layout:
    one buffer, ``[K|V, token, layer, head, dim]`` (MLA: ``[token, layer, dim]``), and its
    ``get_page_buffer_meta``."""

    layout = "page_first"

    def __init__(
        self,
        pages: int,
        page_size: int,
        layers: int,
        heads: int,
        head_dim: int,
        itemsize: int = 2,
        mla: bool = False,
        shared: bool = False,
    ) -> None:
        self.page_size, self.layers, self.heads, self.head_dim = page_size, layers, heads, head_dim
        self.itemsize, self.mla, self.size = itemsize, mla, pages * page_size
        shape = (self.size, layers, head_dim * itemsize) if mla else (2, self.size, layers, heads, head_dim * itemsize)
        self.handle = None
        if shared:  # UMBPHostTensorAllocator's pool, in memory a standalone server can map
            self.allocator = umbp_mod.UMBPHostMemAllocator()
            nbytes = int(np.prod(shape))
            self.handle = self.allocator.alloc(nbytes, umbp_mod.UMBPHostBufferBacking.AnonymousShm, 2 << 20, -1, True)
            if not self.handle:
                raise RuntimeError(f"UMBPHostMemAllocator.alloc({nbytes} bytes) failed")
            self.kv_buffer = np.frombuffer(self.handle.view()[:nbytes], dtype=np.uint8).reshape(shape)
        else:
            self.kv_buffer = np.zeros(shape, dtype=np.uint8)
        self.token_bytes = layers * (1 if mla else heads) * head_dim * itemsize

    def get_page_buffer_meta(self, indices: np.ndarray) -> tuple[list[int], list[int]]:
        """Per page of ``indices`` (page-aligned token indices): the K (and V) page's address,
        and the bytes of one page of K."""
        base = int(self.kv_buffer.ctypes.data)
        v_base = base + self.size * self.token_bytes
        element = self.token_bytes * self.page_size
        ptrs = []
        for index in indices[:: self.page_size]:
            ptrs.append(base + int(index) * self.token_bytes)
            if not self.mla:
                ptrs.append(v_base + int(index) * self.token_bytes)
        return ptrs, [element] * len(ptrs)

    def free(self) -> None:
        """Gives a shared pool's memory back (SGLang's allocator does at exit)."""
        if self.handle is not None:
            del self.kv_buffer
            self.allocator.free(self.handle)
            self.handle = None

    def page_bytes(self, page: int) -> bytes:
        """The bytes of one page (K then V) as the pool holds them."""
        start, stop = page * self.page_size, (page + 1) * self.page_size
        if self.mla:
            return self.kv_buffer[start:stop].tobytes()
        return self.kv_buffer[0, start:stop].tobytes() + self.kv_buffer[1, start:stop].tobytes()


class UmbpStoreReplay:
    """``UMBPStore``'s calls into ``mori.umbp``, in its order (see the module's docstring)."""

    def __init__(self, storage_config: StorageConfig, mem_pool_host: HostKVPool) -> None:
        cfg = umbp_mod.UMBPConfig.from_environment()
        cfg.role = umbp_mod.UMBPRole.Standalone
        extra = storage_config.extra_config
        self.is_mla_backend = storage_config.is_mla_model
        self.local_rank, self.pp_rank = storage_config.tp_rank, storage_config.pp_rank
        if "dram_capacity_bytes" in extra:
            cfg.dram.capacity_bytes = int(extra["dram_capacity_bytes"])
        if "ssd_enabled" in extra:
            cfg.ssd.enabled = strict_bool(extra["ssd_enabled"], "ssd_enabled")
        if "ssd_storage_dir" in extra:
            cfg.ssd.storage_dir = str(extra["ssd_storage_dir"])
        if "ssd_capacity_bytes" in extra:
            cfg.ssd.capacity_bytes = int(extra["ssd_capacity_bytes"])
        if "ssd_copy_async" in extra:
            cfg.copy_pipeline.async_enabled = strict_bool(extra["ssd_copy_async"], "ssd_copy_async")
        if "ssd_copy_queue_depth" in extra:
            cfg.copy_pipeline.queue_depth = int(extra["ssd_copy_queue_depth"])
        if "ssd_segment_size_bytes" in extra:
            cfg.ssd.segment_size_bytes = int(extra["ssd_segment_size_bytes"])
        if "ssd_queue_depth" in extra:
            cfg.ssd.io.queue_depth = int(extra["ssd_queue_depth"])
        if "ssd_copy_worker_threads" in extra:
            cfg.copy_pipeline.worker_threads = int(extra["ssd_copy_worker_threads"])
        if "auto_promote_on_read" in extra:
            cfg.eviction.auto_promote_on_read = strict_bool(extra["auto_promote_on_read"], "auto_promote_on_read")
        if "eviction_policy" in extra:
            cfg.eviction.policy = str(extra["eviction_policy"])
        if "eviction_candidate_window" in extra:
            cfg.eviction.candidate_window = int(extra["eviction_candidate_window"])
        if "ssd_io_backend" in extra:
            backend = str(extra["ssd_io_backend"]).strip().lower()
            cfg.ssd.io.backend = umbp_mod.UMBPIoBackend.Posix if backend == "posix" else umbp_mod.UMBPIoBackend.IoUring
        if "ssd_durability_mode" in extra:
            durability = str(extra["ssd_durability_mode"]).strip().lower()
            cfg.ssd.durability.mode = (
                umbp_mod.UMBPDurabilityMode.Strict
                if durability in ("strict", "sync")
                else umbp_mod.UMBPDurabilityMode.Relaxed
            )
        if "ssd_high_watermark" in extra and hasattr(cfg.ssd, "high_watermark"):
            cfg.ssd.high_watermark = float(extra["ssd_high_watermark"])
        if "ssd_low_watermark" in extra and hasattr(cfg.ssd, "low_watermark"):
            cfg.ssd.low_watermark = float(extra["ssd_low_watermark"])
        master_address = extra.get("master_address", os.environ.get("UMBP_MASTER_ADDRESS") or None)
        standalone_address = extra.get("standalone_address") or os.environ.get("UMBP_STANDALONE_ADDRESS") or None
        self.standalone_expected = bool(standalone_address)
        if master_address and standalone_address:
            raise ValueError("master_address and standalone_address are mutually exclusive")
        if master_address:
            cfg.distributed = self._distributed_config(cfg, extra, str(master_address), mem_pool_host)
        elif standalone_address:
            sp = umbp_mod.UMBPStandaloneProcessConfig()
            sp.address = str(standalone_address)
            auto_start = extra.get("standalone_auto_start", os.environ.get("UMBP_STANDALONE_AUTO_START") or None)
            if auto_start is not None:
                sp.auto_start = strict_bool(auto_start, "standalone_auto_start")
            timeout_ms = extra.get(
                "standalone_startup_timeout_ms", os.environ.get("UMBP_STANDALONE_STARTUP_TIMEOUT_MS") or None
            )
            if timeout_ms is not None:
                sp.startup_timeout_ms = int(timeout_ms)
            cfg.standalone_process = sp
        # Local SSD isolation: one directory per rank when there are several (a pool of its own).
        if cfg.ssd.enabled and storage_config.tp_size > 1 and cfg.standalone_process is None:
            cfg.ssd.storage_dir = os.path.join(cfg.ssd.storage_dir, f"tp{self.local_rank}")
        self.config = cfg
        self.client = umbp_mod.UMBPClient(cfg)
        self.registered: list[tuple[int, int]] = []
        self.register_mem_pool_host(mem_pool_host)
        self.mha_suffix = f"{self.local_rank}"
        self.mla_suffix = ""

    def _distributed_config(self, cfg: Any, extra: dict[str, Any], master_address: str, pool: HostKVPool) -> Any:
        """The ``master_address`` branch: the node's identity, its IO engine and peer service,
        and the master's page size from the host pool's page."""
        dist = umbp_mod.UMBPDistributedConfig()
        dist.master_config.master_address = master_address
        if "ssd_copy_worker_threads" not in extra:
            cfg.copy_pipeline.worker_threads = 1
        node_address = str(extra.get("node_address", os.environ.get("UMBP_NODE_ADDRESS", "127.0.0.1")))
        dist.master_config.node_address = node_address
        dist.master_config.node_id = str(
            extra.get("node_id", f"{node_address}:dp0:pp{self.pp_rank}:tp{self.local_rank}")
        )
        tags = extra.get("node_tags", extra.get("tags"))
        if hasattr(dist.master_config, "tags"):
            dist.master_config.tags = (
                [t.strip() for t in tags.split(",") if t.strip()]
                if isinstance(tags, str)
                else [str(t) for t in tags or []]
            )
        if "auto_heartbeat" in extra:
            dist.master_config.auto_heartbeat = strict_bool(extra["auto_heartbeat"], "auto_heartbeat")
        dist.io_engine.host = str(extra.get("io_engine_host", node_address))
        if "io_engine_port" in extra:
            dist.io_engine.port = int(extra["io_engine_port"]) + self.local_rank
        if "staging_buffer_size" in extra:
            dist.staging_buffer_size = int(extra["staging_buffer_size"])
        if "peer_service_port" in extra:
            dist.peer_service_port = int(extra["peer_service_port"]) + self.local_rank
        if "cache_remote_fetches" in extra:
            dist.cache_remote_fetches = strict_bool(extra["cache_remote_fetches"], "cache_remote_fetches")
        page_byte_size = (
            int(extra["dram_page_size"])
            if "dram_page_size" in extra
            else pool.get_page_buffer_meta(np.zeros(pool.page_size, dtype=np.int64))[1][0]
        )
        if page_byte_size > 0 and hasattr(dist, "dram_page_size"):
            dist.dram_page_size = int(page_byte_size)
        return dist

    def register_mem_pool_host(self, pool: HostKVPool) -> None:
        """``register_mem_pool_host``: the deployment mode, then, in a distributed or standalone
        deployment, the host KV buffer registered for zero copy."""
        self.mem_pool_host = pool
        mode = self.client.get_deployment_mode()
        standalone = mode == umbp_mod.UMBPDeploymentMode.StandaloneProcess
        if self.standalone_expected and not standalone:
            raise RuntimeError(f"UMBPStore expected standalone-process mode, but the client reported {mode!r}")
        if not (self.client.is_distributed() or standalone):
            return
        base, size = int(pool.kv_buffer.ctypes.data), int(pool.kv_buffer.nbytes)
        if self.client.register_memory(base, size):
            self.registered.append((base, size))
        elif standalone:
            raise RuntimeError(
                "UMBPStore: register_memory returned false in standalone-process mode; no fallback path exists."
            )

    def _batch_preprocess(self, keys: list[str], host_indices: np.ndarray) -> tuple[list[str], list[int], list[int]]:
        assert len(keys) == len(host_indices) // self.mem_pool_host.page_size
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if self.is_mla_backend:
            key_list = [f"{k}_{self.mla_suffix}_k" for k in keys]  # the same on every TP rank
        else:
            key_list = [f"{k}_{self.mha_suffix}_{kv}" for k in keys for kv in ("k", "v")]
        assert len(key_list) == len(ptrs)
        return key_list, ptrs, sizes

    def _batch_postprocess(self, results: list[bool]) -> list[bool]:
        if self.is_mla_backend:
            return list(results)
        return [k and v for k, v in zip(results[::2], results[1::2])]

    def batch_set_v1(self, keys: list[str], host_indices: np.ndarray, prefix_keys: list[str] | None) -> list[bool]:
        key_strs, ptrs, sizes = self._batch_preprocess(keys, host_indices)
        depths: list[int] = []
        if prefix_keys is not None:
            per_key = 1 if self.is_mla_backend else 2
            depths = [len(prefix_keys) + i for i in range(len(keys)) for _ in range(per_key)]
        if depths:
            results = self.client.batch_put_from_ptr_with_depth(key_strs, list(ptrs), sizes, depths)
        else:
            results = self.client.batch_put_from_ptr(key_strs, list(ptrs), sizes)
        return self._batch_postprocess(results)

    def batch_get_v1(self, keys: list[str], host_indices: np.ndarray) -> list[bool]:
        key_strs, ptrs, sizes = self._batch_preprocess(keys, host_indices)
        return self._batch_postprocess(self.client.batch_get_into_ptr(key_strs, list(ptrs), sizes))

    def batch_exists(self, keys: list[str]) -> int:
        if self.is_mla_backend:
            return self.client.batch_exists_consecutive([f"{k}_{self.mla_suffix}_k" for k in keys])
        query = [f"{k}_{self.mha_suffix}_{kv}" for k in keys for kv in ("k", "v")]
        return self.client.batch_exists_consecutive(query) // 2

    def on_block_stored(self, block_hashes: list[int], medium: str) -> bool:
        """``KVEventsSubscriber.on_event`` for a ``BlockStored``: the hashes reported at the
        medium's tier (GPU: HBM, else DRAM)."""
        tier = umbp_mod.UMBPTierType.HBM if medium == "GPU" else umbp_mod.UMBPTierType.DRAM
        return self.client.report_external_kv_blocks([str(h) for h in block_hashes], tier)

    def on_block_removed(self, block_hashes: list[int], medium: str) -> bool:
        tier = umbp_mod.UMBPTierType.HBM if medium == "GPU" else umbp_mod.UMBPTierType.DRAM
        return self.client.revoke_external_kv_blocks([str(h) for h in block_hashes], tier)

    def on_all_blocks_cleared(self) -> tuple[bool, bool]:
        return (
            self.client.revoke_all_external_kv_blocks_at_tier(umbp_mod.UMBPTierType.HBM),
            self.client.revoke_all_external_kv_blocks_at_tier(umbp_mod.UMBPTierType.DRAM),
        )

    def close(self) -> bool:
        """``close``: flush, then the client is dropped (here, closed); the flush's result."""
        flushed = bool(self.client.flush())
        self.client.close()
        return flushed
