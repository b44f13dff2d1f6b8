"""The default metadata store: dictionaries in the master's process, under one lock."""

from __future__ import annotations

import collections
import dataclasses
import threading

from .store import (
    TIERS,
    ClientRecord,
    ClientStatus,
    HeartbeatResult,
    HeartbeatStatus,
    KvEvent,
    Limits,
    Location,
    MetadataStore,
    QuotaExceeded,
    TierCapacity,
)


@dataclasses.dataclass(slots=True)
class _Block:
    sizes: dict[tuple[str, int], int]  # (node, tier) -> size
    lease_until_ms: int = 0


class InMemoryStore(MetadataStore):
    """Everything in dictionaries; lost when the master stops (clients re-register and send a
    full sync when their heartbeat is answered UNKNOWN)."""

    def __init__(self, limits: Limits) -> None:
        super().__init__(limits)
        self._lock = threading.Lock()
        self._clients: dict[str, ClientRecord] = {}
        self._blocks: dict[str, _Block] = {}
        self._node_keys: dict[str, set[str]] = {}
        # (node, tier) -> keys in least-recently-accessed order: eviction advice is O(limit).
        self._lru: dict[tuple[str, int], collections.OrderedDict[str, None]] = {}
        self._ext: dict[str, dict[str, int]] = {}  # hash -> node -> tier bitmask
        self._ext_by_node: dict[str, set[str]] = {}
        self._hits: dict[str, list[int]] = {}  # hash -> [count, last_seen_ms]
        self._now_ms = 0  # the heartbeat being applied

    # ---- clients ----------------------------------------------------------------------
    def register_client(self, record: ClientRecord, now_ms: int, stale_after_ms: int) -> bool:
        with self._lock:
            old = self._clients.get(record.node_id)
            if old is not None:
                live = old.status == ClientStatus.ALIVE and now_ms - old.last_heartbeat_ms <= stale_after_ms
                if live:
                    return False
                self._drop_node(record.node_id)
            elif len(self._clients) >= self.limits.max_clients:
                raise QuotaExceeded(
                    f"the master holds {len(self._clients)} clients, its limit (UMBP_MASTER_MAX_CLIENTS)"
                )
            rec = dataclasses.replace(
                record,
                status=ClientStatus.ALIVE,
                last_heartbeat_ms=now_ms,
                registered_at_ms=now_ms,
                seq=0,
            )
            self._clients[record.node_id] = rec
            self._node_keys[record.node_id] = set()
            return True

    def unregister_client(self, node_id: str) -> bool:
        with self._lock:
            if node_id not in self._clients:
                return False
            self._drop_node(node_id)
            return True

    def _drop_node(self, node_id: str) -> None:
        self._clients.pop(node_id, None)
        for key in self._node_keys.pop(node_id, set()):
            block = self._blocks[key]
            for tier in TIERS:
                block.sizes.pop((node_id, tier), None)
            if not block.sizes:
                del self._blocks[key]
        for tier in TIERS:
            self._lru.pop((node_id, tier), None)
        self._revoke_ext_for_node(node_id)

    def get_client(self, node_id: str) -> ClientRecord | None:
        with self._lock:
            rec = self._clients.get(node_id)
            return dataclasses.replace(rec) if rec else None

    def list_clients(self) -> list[ClientRecord]:
        with self._lock:
            return [dataclasses.replace(r) for r in self._clients.values()]

    def apply_heartbeat(
        self,
        node_id: str,
        first_seq: int,
        last_seq: int,
        now_ms: int,
        caps: dict[int, TierCapacity],
        events: list[KvEvent],
        full_sync: bool,
    ) -> HeartbeatResult:
        with self._lock:
            rec = self._clients.get(node_id)
            if rec is None:
                return HeartbeatResult(HeartbeatStatus.UNKNOWN, 0)
            if not full_sync and first_seq != rec.seq + 1:
                rec.last_heartbeat_ms = now_ms
                rec.status = ClientStatus.ALIVE
                return HeartbeatResult(HeartbeatStatus.SEQ_GAP, rec.seq)
            self._now_ms = now_ms
            if full_sync:
                final = {(e.key, e.tier): e.size for e in events if e.add}
                self._check_full_sync_quota(node_id, final)
                self._clear_node_blocks(node_id)
                for (key, tier), size in final.items():
                    self._add(node_id, key, tier, size, now_ms)
            else:
                touched: dict[tuple[str, int], int | None] = {}
                for e in events:
                    touched[(e.key, e.tier)] = e.size if e.add else None
                self._check_delta_quota(node_id, touched)
                for (key, tier), change in touched.items():
                    if change is None:
                        self._remove(node_id, key, tier)
                    else:
                        self._add(node_id, key, tier, change, now_ms)
            rec.seq = last_seq
            if caps:  # a heartbeat without capacities keeps the last ones
                rec.caps = caps
            rec.last_heartbeat_ms = now_ms
            rec.status = ClientStatus.ALIVE
            return HeartbeatResult(HeartbeatStatus.APPLIED, last_seq)

    def _check_delta_quota(self, node_id: str, touched: dict[tuple[str, int], int | None]) -> None:
        mine = self._node_keys[node_id]
        node_count, total = len(mine), len(self._blocks)
        for key in {k for k, _ in touched}:
            block = self._blocks.get(key)
            sizes = block.sizes if block else {}

            def held(tier: int, key: str = key, sizes: dict = sizes) -> bool:
                if (key, tier) in touched:
                    return touched[(key, tier)] is not None
                return (node_id, tier) in sizes

            after = any(held(t) for t in TIERS)
            node_count += int(after) - int(key in mine)
            others = any(n != node_id for n, _ in sizes)
            total += int(after or others) - int(block is not None)
        self._check_counts(node_id, node_count, total)

    def _check_full_sync_quota(self, node_id: str, final: dict[tuple[str, int], int]) -> None:
        mine = self._node_keys[node_id]
        new_keys = {k for k, _ in final}
        total = len(self._blocks)
        for key in mine - new_keys:  # keys only this node held disappear
            if all(n == node_id for n, _ in self._blocks[key].sizes):
                total -= 1
        total += sum(1 for k in new_keys if k not in self._blocks)
        self._check_counts(node_id, len(new_keys), total)

    def _check_counts(self, node_id: str, node_count: int, total: int) -> None:
        """Refuses growth past a limit; a change that shrinks (or keeps) a count always passes.
        A refused heartbeat still says the node is alive."""
        message = ""
        if node_count > self.limits.max_keys_per_client and node_count > len(self._node_keys[node_id]):
            message = (
                f"node {node_id!r} would own {node_count} keys, over its quota of "
                f"{self.limits.max_keys_per_client} (UMBP_MASTER_MAX_KEYS_PER_CLIENT)"
            )
        elif total > self.limits.max_keys and total > len(self._blocks):
            message = (
                f"the block index would hold {total} keys, over its limit of "
                f"{self.limits.max_keys} (UMBP_MASTER_MAX_KEYS)"
            )
        if message:
            self._clients[node_id].last_heartbeat_ms = self._now_ms
            raise QuotaExceeded(message)

    def _add(self, node_id: str, key: str, tier: int, size: int, now_ms: int) -> None:
        block = self._blocks.setdefault(key, _Block({}))
        block.sizes[(node_id, tier)] = size
        self._node_keys[node_id].add(key)
        lru = self._lru.setdefault((node_id, tier), collections.OrderedDict())
        lru[key] = None
        lru.move_to_end(key)

    def _remove(self, node_id: str, key: str, tier: int) -> None:
        block = self._blocks.get(key)
        if block is None or block.sizes.pop((node_id, tier), None) is None:
            return
        lru = self._lru.get((node_id, tier))
        if lru is not None:
            lru.pop(key, None)
        if not any((node_id, t) in block.sizes for t in TIERS):
            self._node_keys[node_id].discard(key)
        if not block.sizes:
            del self._blocks[key]

    def _clear_node_blocks(self, node_id: str) -> None:
        for key in list(self._node_keys[node_id]):
            for tier in TIERS:
                self._remove(node_id, key, tier)

    def expire_stale_clients(self, cutoff_ms: int) -> list[str]:
        with self._lock:
            dead = [n for n, r in self._clients.items() if r.last_heartbeat_ms < cutoff_ms]
            for node_id in dead:
                self._drop_node(node_id)
            return dead

    # ---- block index ------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> list[list[Location]]:
        with self._lock:
            out = []
            for key in keys:
                block = self._blocks.get(key)
                out.append([Location(n, t, s) for (n, t), s in block.sizes.items()] if block else [])
            return out

    def exists(self, keys: list[str], alive: set[str]) -> list[bool]:
        out = []
        with self._lock:
            blocks = self._blocks
            # A block in the index has a location on at least one registered node: while every
            # registered node is alive, a key is held exactly when it is in the index (0.1 ms
            # less for 1,024 keys than looking at each key's nodes).
            if alive.issuperset(self._clients):
                return list(map(blocks.__contains__, keys))
            for key in keys:  # plain loops: a generator per key took 4x as long (0.8 ms for 1,024 keys)
                held = False
                block = blocks.get(key)
                if block is not None:
                    for node, _ in block.sizes:
                        if node in alive:
                            held = True
                            break
                out.append(held)
        return out

    def touch(self, keys: list[str], now_ms: int, lease_ms: int) -> None:
        with self._lock:
            for key in keys:
                block = self._blocks.get(key)
                if block is None:
                    continue
                block.lease_until_ms = now_ms + lease_ms
                for node_tier in block.sizes:
                    lru = self._lru.get(node_tier)
                    if lru is not None and key in lru:
                        lru.move_to_end(key)

    def key_count(self) -> int:
        with self._lock:
            return len(self._blocks)

    def eviction_candidates(self, node_id: str, tier: int, limit: int, now_ms: int) -> list[tuple[str, int]]:
        with self._lock:
            out: list[tuple[str, int]] = []
            for key in self._lru.get((node_id, tier), ()):
                if len(out) >= limit:
                    break
                block = self._blocks[key]
                if block.lease_until_ms > now_ms:
                    continue
                out.append((key, block.sizes[(node_id, tier)]))
            return out

    # ---- external KV ------------------------------------------------------------------
    def report_external_kv(self, node_id: str, hashes: list[str], tier: int) -> bool:
        with self._lock:
            rec = self._clients.get(node_id)
            if rec is None or rec.status != ClientStatus.ALIVE:
                return False
            mine = self._ext_by_node.setdefault(node_id, set())
            grown = len(mine) + len(set(hashes) - mine)
            if grown > self.limits.max_external_kv_per_client:
                raise QuotaExceeded(
                    f"node {node_id!r} would report {grown} external KV hashes, over its quota of "
                    f"{self.limits.max_external_kv_per_client} (UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT)"
                )
            bit = 1 << tier
            for h in hashes:
                nodes = self._ext.setdefault(h, {})
                nodes[node_id] = nodes.get(node_id, 0) | bit
                mine.add(h)
            return True

    def _clear_ext_bits(self, node_id: str, hashes: list[str] | set[str], mask: int) -> None:
        mine = self._ext_by_node.get(node_id)
        if mine is None:
            return
        for h in hashes:
            nodes = self._ext.get(h)
            if nodes is None or node_id not in nodes:
                continue
            left = nodes[node_id] & ~mask
            if left:
                nodes[node_id] = left
                continue
            del nodes[node_id]
            mine.discard(h)
            if not nodes:
                del self._ext[h]
        if not mine:
            del self._ext_by_node[node_id]

    def revoke_external_kv(self, node_id: str, hashes: list[str], tier: int) -> None:
        with self._lock:
            self._clear_ext_bits(node_id, hashes, 1 << tier)

    def revoke_external_kv_at_tier(self, node_id: str, tier: int) -> None:
        with self._lock:
            self._clear_ext_bits(node_id, set(self._ext_by_node.get(node_id, ())), 1 << tier)

    def revoke_external_kv_for_node(self, node_id: str) -> None:
        with self._lock:
            self._revoke_ext_for_node(node_id)

    def _revoke_ext_for_node(self, node_id: str) -> None:
        self._clear_ext_bits(node_id, set(self._ext_by_node.get(node_id, ())), -1)

    def external_kv_count(self, node_id: str) -> int:
        with self._lock:
            return len(self._ext_by_node.get(node_id, ()))

    def match_external_kv(self, hashes: list[str], count_as_hit: bool, now_ms: int) -> dict[str, dict[int, list[str]]]:
        with self._lock:
            out: dict[str, dict[int, list[str]]] = {}
            for h in dict.fromkeys(hashes):
                nodes = self._ext.get(h)
                if not nodes:
                    continue
                for node_id, mask in nodes.items():
                    by_tier = out.setdefault(node_id, {})
                    for tier in TIERS:
                        if mask & (1 << tier):
                            by_tier.setdefault(tier, []).append(h)
                if count_as_hit:
                    entry = self._hits.get(h)
                    if entry is not None:
                        entry[0] += 1
                        entry[1] = now_ms
                    elif len(self._hits) < self.limits.max_hit_entries:
                        self._hits[h] = [1, now_ms]
            return out

    def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]:
        with self._lock:
            return [(h, self._hits[h][0]) for h in dict.fromkeys(hashes) if h in self._hits]

    def gc_hits(self, cutoff_ms: int) -> int:
        with self._lock:
            old = [h for h, (_, seen) in self._hits.items() if seen < cutoff_ms]
            for h in old:
                del self._hits[h]
            return len(old)
