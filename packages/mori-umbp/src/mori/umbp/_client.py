"""``UMBPClient``: MORI's client, put and get by key from and into raw pointers."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mori.core.log import get_logger
from mori.io import MemoryLocationType

from ._checks import as_list, check_address, check_key, check_keys, check_lengths, check_offset, check_size
from ._config import UMBPConfig, validate
from ._enums import UMBPDeploymentMode, UMBPTierType
from ._external import UMBPExternalKvHitCountEntry, UMBPExternalKvMatch
from ._pools import LocalPool, Pool
from ._store import LocalStore

if TYPE_CHECKING:
    from ._cluster import ClusterNode

_log = get_logger("umbp")


class UMBPClient:
    """A KV-cache pool: MORI's ``UMBPClient``.

    ``UMBPClient(config)`` builds the pool ``config`` describes (:class:`UMBPConfig`; the
    default when omitted): a DRAM tier of ``config.dram.capacity_bytes`` in one host buffer and,
    when ``config.ssd.enabled``, an SSD tier of segment files in ``config.ssd.storage_dir``
    behind it. Values are put and got by key from and into raw addresses of host memory. A key
    is put once: putting a stored key again leaves it as it is and succeeds. With
    ``config.distributed`` naming a master, the pool is a node of a cluster: puts are routed by
    the master and gets served by whichever node holds the key, pages moving by mori-io.

    Errors: an argument of the wrong type is a TypeError, a malformed key, size, address or
    batch shape a ValueError, both raised before anything changes; a get of an absent key, of a
    stored key with another size, or a put that finds no room returns False. Every method is
    thread-safe; the copies run without the GIL. ``close()`` (or ``with``) releases the pool;
    after it every method raises RuntimeError.
    """

    def __init__(self, config: UMBPConfig | None = None) -> None:
        cfg = copy.deepcopy(config) if config is not None else UMBPConfig()
        validate(cfg)
        self._config = cfg
        self._regions: dict[int, int] = {}
        self._regions_lock = threading.Lock()
        self._store: LocalStore | None = None
        self._cluster: ClusterNode | None = None
        self._pool: Pool
        if cfg.standalone_process is not None:
            from ._standalone import StandaloneConnection  # needs the grpc extra

            #: The largest value: the server's store says, per call.
            self.max_value_size = (1 << 63) - 1
            self._pool = StandaloneConnection(cfg.standalone_process)
        else:
            cluster = cfg.distributed is not None and bool(cfg.distributed.master_config.master_address)
            reserve = 0
            if cluster:
                from ._peer import ssd_reserve_bytes  # needs the grpc extra

                reserve = ssd_reserve_bytes(cfg.ssd.enabled)
            self._store = LocalStore(cfg, reserve)
            most = self._store.buffer_size
            if cfg.ssd.enabled:
                most = min(most, cfg.ssd.segment_size_bytes)
            #: The largest value: it must fit the DRAM tier, and one SSD segment when there is one.
            self.max_value_size = most
            self._pool = LocalPool(self._store)
            if cluster:
                from ._cluster import ClusterNode  # needs the grpc extra

                try:
                    self._pool = self._cluster = ClusterNode(cfg, self._store, most)
                except BaseException:
                    self._store.close()
                    raise
        self._finalizer = weakref.finalize(self, self._pool.close)

    # -- single keys --------------------------------------------------------------------------

    def put_from_ptr(self, key: str, src: int, size: int) -> bool:
        """Stores ``size`` bytes at address ``src`` as ``key``; False when there is no room."""
        key = check_key(key)
        src = check_address(src, "src")
        size = check_size(size, "size", self.max_value_size)
        return self._pool.put([key], [src], [size], [-1])[0]

    def get_into_ptr(self, key: str, dst: int, size: int) -> bool:
        """Copies ``key``'s value (of exactly ``size`` bytes) to address ``dst``; False when
        absent or of another size."""
        key = check_key(key)
        dst = check_address(dst, "dst")
        size = check_size(size, "size", self.max_value_size)
        return self._pool.get([key], [dst], [size])[0]

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (in any tier; on a node of a cluster, on any live node)."""
        return self._pool.exists([check_key(key)])[0]

    # -- batches ------------------------------------------------------------------------------

    def batch_put_from_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """:meth:`put_from_ptr` for each ``(keys[i], ptrs[i], sizes[i])``; one result each."""
        return self.batch_put_from_ptr_with_depth(keys, ptrs, sizes, [])

    def batch_put_from_ptr_with_depth(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int], depths: Sequence[int]
    ) -> list[bool]:
        """:meth:`batch_put_from_ptr` with each key's prefix depth (SGLang's radix-tree depth):
        among pages equally old, the deepest leave DRAM first. An empty ``depths``, or a depth
        of -1, is plain LRU."""
        keys, ptrs, sizes = self._batch(keys, ptrs, sizes, "ptrs")
        depth_list = as_list(depths, "depths")
        if depth_list:
            check_lengths(keys=keys, depths=depth_list)
            for i, depth in enumerate(depth_list):
                if isinstance(depth, bool) or not isinstance(depth, int) or depth < -1:
                    raise ValueError(f"depths[{i}] must be an int >= -1, got {depth!r}")
        else:
            depth_list = [-1] * len(keys)
        return self._pool.put(keys, ptrs, sizes, depth_list) if keys else []

    def batch_get_into_ptr(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[bool]:
        """:meth:`get_into_ptr` for each key; SSD hits are read together, off this thread."""
        keys, ptrs, sizes = self._batch(keys, ptrs, sizes, "ptrs")
        return self._pool.get(keys, ptrs, sizes) if keys else []

    def batch_get_ranges_into_ptr(
        self,
        keys: Sequence[str],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        src_offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        """Copies byte ranges of stored values out: for key ``i``, ``sizes[i][j]`` bytes from
        offset ``src_offsets[i][j]`` of its value to ``ptrs[i][j]``. A key is False when absent
        or when a range runs past its value's end. Served from this process's store (on a node of a
        cluster, its own keys; a standalone client: all False)."""
        keys = check_keys(as_list(keys, "keys"))
        plans = self._ranges(keys, ptrs, sizes, src_offsets, "src_offsets")
        store = self._store
        if store is None:
            return [False] * len(keys)
        return [store.read_ranges(key, ranges) for key, ranges in zip(keys, plans)]

    def batch_put_ranges_from_ptr(
        self,
        keys: Sequence[str],
        object_sizes: Sequence[int],
        ptrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        dst_offsets: Sequence[Sequence[int]],
    ) -> list[bool]:
        """Stores values assembled from scattered buffers: value ``i`` is ``object_sizes[i]``
        bytes, and its ranges (``sizes[i][j]`` bytes at ``ptrs[i][j]``, placed at
        ``dst_offsets[i][j]``) must tile it exactly, else ValueError. A value is published
        whole or not at all, into this process's store (a standalone client: all False)."""
        keys = check_keys(as_list(keys, "keys"))
        totals = [
            check_size(s, f"object_sizes[{i}]", self.max_value_size)
            for i, s in enumerate(as_list(object_sizes, "object_sizes"))
        ]
        check_lengths(keys=keys, object_sizes=totals)
        plans = self._ranges(keys, ptrs, sizes, dst_offsets, "dst_offsets")
        for i, (ranges, total) in enumerate(zip(plans, totals)):
            covered = 0
            for _, size, offset in sorted(ranges, key=lambda r: r[2]):
                if offset != covered:
                    raise ValueError(
                        f"ranges of keys[{i}] do not tile [0, {total}): "
                        f"{'gap' if offset > covered else 'overlap'} at byte {min(offset, covered)}"
                    )
                covered += size
            if covered != total:
                raise ValueError(f"ranges of keys[{i}] cover {covered} bytes of {total}")
        return [self._put_ranges(key, total, ranges) for key, total, ranges in zip(keys, totals, plans)]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` for each key."""
        keys = check_keys(as_list(keys, "keys"))
        return self._pool.exists(keys) if keys else []

    def batch_exists_consecutive(self, keys: Sequence[str]) -> int:
        """How many keys, from the first on, are stored: the count stops at the first absent
        one (SGLang's prefix hit)."""
        keys = check_keys(as_list(keys, "keys"))
        found = self._pool.exists(keys) if keys else []
        return found.index(False) if False in found else len(found)

    # -- lifecycle ----------------------------------------------------------------------------

    def clear(self) -> bool:
        """Removes every key from every tier (on a node of a cluster, this node's keys)."""
        return self._pool.clear()

    def flush(self) -> bool:
        """Waits until pages on their way to SSD are there (and, with the Relaxed durability
        mode, on the device); False when that did not finish in time."""
        return self._pool.flush()

    def close(self) -> None:
        """Releases the pool: drops every key, removes the SSD tier's files, unmaps the DRAM
        buffer. Safe to call again."""
        self._finalizer()

    def __enter__(self) -> UMBPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- introspection ------------------------------------------------------------------------

    def is_distributed(self) -> bool:
        """True when the pool lives in this process, a node of a cluster or one on its own (as
        MORI's embedded client reports); False for a client of a standalone server."""
        return self._store is not None

    def get_deployment_mode(self) -> UMBPDeploymentMode:
        """``Distributed`` for a pool in this process, ``StandaloneProcess`` for a client of a
        standalone server (see :class:`UMBPDeploymentMode`)."""
        return UMBPDeploymentMode.Distributed if self._store is not None else UMBPDeploymentMode.StandaloneProcess

    def get_backend_mode(self) -> UMBPDeploymentMode:
        """The mode of the pool behind this client (a standalone server's, as its Ping says)."""
        return self._pool.backend_mode()

    def supports_ranged_io(self) -> bool:
        """Whether the ranges methods are served: by a pool in this process."""
        return self._store is not None

    def stats(self) -> dict[str, int]:
        """Keys and bytes in each tier of this process's store, and the tiers' capacities
        (empty for a client of a standalone server)."""
        return self._store.stats() if self._store is not None else {}

    # -- registered memory --------------------------------------------------------------------

    def register_memory(
        self, ptr: int, size: int, loc: MemoryLocationType = MemoryLocationType.CPU, device: int = -1
    ) -> bool:
        """Registers the caller's host buffer ``[ptr, ptr + size)`` (SGLang's host KV pool) for
        zero-copy transfers. Puts and gets work on any host address; a node of a cluster moves
        registered buffers' pages straight to and from peers. False for GPU memory, which this
        pool does not copy. Registering a buffer again is a success."""
        ptr = check_address(ptr, "ptr")
        size = check_size(size, "size", (1 << 64) - 1)
        if not isinstance(loc, MemoryLocationType):
            raise TypeError(f"loc must be a MemoryLocationType, not {type(loc).__name__}")
        if loc != MemoryLocationType.CPU:
            _log.warning("register_memory: %s memory (device %d) is not supported; use host memory", loc.name, device)
            return False
        with self._regions_lock:
            # Buffers may overlap (SGLang's pools round their extents up to whole huge pages).
            if not self._pool.register(ptr, max(size, self._regions.get(ptr, 0))):
                return False
            self._regions[ptr] = max(size, self._regions.get(ptr, 0))
        return True

    def deregister_memory(self, ptr: int) -> None:
        """Forgets the buffer registered at ``ptr`` (nothing when none is)."""
        ptr = check_address(ptr, "ptr")
        with self._regions_lock:
            if self._regions.pop(ptr, None) is not None:
                self._pool.deregister(ptr)

    # -- external KV blocks (the master's index) ----------------------------------------------

    def report_external_kv_blocks(self, hashes: Sequence[str], tier: UMBPTierType) -> bool:
        """Tells the master that this node holds ``hashes`` at ``tier`` outside the pool (an
        engine's GPU or host cache). False without a master: there is no index to tell."""
        checked = self._check_hashes(hashes, tier)
        return self._cluster.report_external(checked, tier, revoke=False) if self._cluster else False

    def revoke_external_kv_blocks(self, hashes: Sequence[str], tier: UMBPTierType) -> bool:
        """Withdraws ``hashes`` at ``tier`` from the master's index. False without a master."""
        checked = self._check_hashes(hashes, tier)
        return self._cluster.report_external(checked, tier, revoke=True) if self._cluster else False

    def revoke_all_external_kv_blocks_at_tier(self, tier: UMBPTierType) -> bool:
        """Withdraws every hash this node reported at ``tier``. False without a master."""
        self._check_hashes([], tier)
        return self._cluster.revoke_all_external(tier) if self._cluster else False

    def match_external_kv(self, hashes: Sequence[str], count_as_hit: bool = False) -> list[UMBPExternalKvMatch]:
        """The nodes holding any of ``hashes``, by tier; ``count_as_hit`` for a real routing
        query. Empty without a master."""
        checked = self._check_hashes(hashes, UMBPTierType.Unknown)
        return self._cluster.match_external(checked, bool(count_as_hit)) if self._cluster else []

    def get_external_kv_hit_counts(self, hashes: Sequence[str]) -> list[UMBPExternalKvHitCountEntry]:
        """How often each of ``hashes`` was routed to (those with a count). Empty without a master."""
        checked = self._check_hashes(hashes, UMBPTierType.Unknown)
        return self._cluster.external_hit_counts(checked) if self._cluster else []

    # -- inside -------------------------------------------------------------------------------

    def _batch(self, keys: Any, ptrs: Any, sizes: Any, ptr_name: str) -> tuple[list[str], list[int], list[int]]:
        keys, ptrs, sizes = as_list(keys, "keys"), as_list(ptrs, ptr_name), as_list(sizes, "sizes")
        check_lengths(keys=keys, **{ptr_name: ptrs}, sizes=sizes)
        return (
            check_keys(keys),
            [check_address(p, f"{ptr_name}[{i}]") for i, p in enumerate(ptrs)],
            [check_size(s, f"sizes[{i}]", self.max_value_size) for i, s in enumerate(sizes)],
        )

    def _ranges(
        self, keys: list[str], ptrs: Any, sizes: Any, offsets: Any, offset_name: str
    ) -> list[list[tuple[int, int, int]]]:
        """Per key, its ranges as ``(address, size, offset)``, checked."""
        ptrs, sizes, offsets = as_list(ptrs, "ptrs"), as_list(sizes, "sizes"), as_list(offsets, offset_name)
        check_lengths(keys=keys, ptrs=ptrs, sizes=sizes, **{offset_name: offsets})
        plans = []
        for i in range(len(keys)):
            p, s, o = (
                as_list(ptrs[i], f"ptrs[{i}]"),
                as_list(sizes[i], f"sizes[{i}]"),
                as_list(offsets[i], f"{offset_name}[{i}]"),
            )
            check_lengths(**{f"ptrs[{i}]": p, f"sizes[{i}]": s, f"{offset_name}[{i}]": o})
            if not p:
                raise ValueError(f"keys[{i}] has no ranges")
            plans.append(
                [
                    (
                        check_address(p[j], f"ptrs[{i}][{j}]"),
                        check_size(s[j], f"sizes[{i}][{j}]", self.max_value_size),
                        check_offset(o[j], f"{offset_name}[{i}][{j}]"),
                    )
                    for j in range(len(p))
                ]
            )
        return plans

    def _put_ranges(self, key: str, total: int, ranges: list[tuple[int, int, int]]) -> bool:
        return self._store.write_ranges(key, total, ranges) if self._store is not None else False

    @staticmethod
    def _check_hashes(hashes: Any, tier: Any) -> list[str]:
        if not isinstance(tier, UMBPTierType):
            raise TypeError(f"tier must be a UMBPTierType, not {type(tier).__name__}")
        return check_keys(as_list(hashes, "hashes"), "hashes")
