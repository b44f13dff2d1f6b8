"""The Redis metadata store (redis-py): MORI's key layout, one Lua script per mutation.

All state lives in Redis, so a master restarted on the same Redis (and namespace) serves the
index it had at once; heartbeats carry on from the sequence number Redis kept. A Redis that
cannot be reached makes the call fail with UNAVAILABLE, never with stale data.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.exceptions

from . import redis_lua
from .settings import MasterSettings
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
    StoreUnavailable,
    TierCapacity,
)

T = TypeVar("T")

#: The scripts whose work grows with what one node holds, and their timeout (at least).
BULK_SCRIPTS = frozenset({"REGISTER_CLIENT", "UNREGISTER_CLIENT", "APPLY_HEARTBEAT", "EXPIRE_STALE"})
BULK_TIMEOUT_S = 60.0


def _url(uri: str) -> str:
    """MORI writes ``tcp://host:port``; redis-py wants ``redis://host:port``."""
    return "redis://" + uri[len("tcp://") :] if uri.startswith("tcp://") else uri


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def encode_caps(caps: dict[int, TierCapacity]) -> str:
    """MORI's ``tier:total:avail;...``, with max_allocatable as a fourth number."""
    return ";".join(f"{t}:{c.total}:{c.available}:{c.max_allocatable}" for t, c in sorted(caps.items()))


def decode_caps(blob: str) -> dict[int, TierCapacity]:
    out: dict[int, TierCapacity] = {}
    for part in filter(None, blob.split(";")):
        tier, total, available, *rest = (int(x) for x in part.split(":"))
        out[tier] = TierCapacity(total, available, rest[0] if rest else 0)
    return out


class RedisStore(MetadataStore):
    def __init__(self, settings: MasterSettings, limits: Limits) -> None:
        super().__init__(limits)
        if not settings.redis_uri:
            raise ValueError("UMBP_METADATA_BACKEND=redis needs UMBP_REDIS_URI (e.g. tcp://127.0.0.1:6379)")
        self.prefix = "{umbp:" + settings.redis_namespace + "}"
        options: dict[str, Any] = {
            "socket_connect_timeout": settings.redis_connect_timeout_ms / 1000,
            "socket_timeout": settings.redis_socket_timeout_ms / 1000,
            "password": settings.redis_password or None,
            "max_connections": settings.redis_pool_size or settings.max_pollers + 8,
        }
        seeds = [_url(u.strip()) for u in settings.redis_uri.split(",") if u.strip()]
        # Every key shares the hash tag, so a cluster client sends each script to one node.
        connect: Any = redis.Redis.from_url
        if settings.redis_cluster:
            from redis.cluster import RedisCluster

            connect = RedisCluster.from_url
        self.client = connect(seeds[0], **options)
        # The scripts whose work grows with a node (a full sync lists all it holds; dropping a
        # node wipes all it held) get connections of their own with a longer timeout: Redis runs
        # a script to its end, so a timeout would only hide that the change was made.
        bulk_timeout = max(settings.redis_socket_timeout_ms / 1000, BULK_TIMEOUT_S)
        self.bulk = connect(seeds[0], **{**options, "socket_timeout": bulk_timeout, "max_connections": 8})
        self._scripts = {
            name: self.client.register_script(getattr(redis_lua, name))
            for name in (
                "REGISTER_CLIENT",
                "UNREGISTER_CLIENT",
                "APPLY_HEARTBEAT",
                "EXPIRE_STALE",
                "TOUCH",
                "EXISTS_LIVE",
                "EVICTION_CANDIDATES",
                "REPORT_EXTERNAL_KV",
                "REVOKE_EXTERNAL_KV",
                "MATCH_EXTERNAL_KV",
                "GC_HITS",
            )
        }
        self._guard(self.client.ping)

    # ---- plumbing ---------------------------------------------------------------------
    def _guard(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except redis.exceptions.RedisError as e:  # down, timing out, out of memory, read-only replica...
            raise StoreUnavailable(f"Redis: {type(e).__name__}: {e}") from e

    def _run(self, name: str, *args: object) -> Any:
        argv = [self.prefix, *args]
        client = self.bulk if name in BULK_SCRIPTS else self.client
        return self._guard(lambda: self._scripts[name](keys=[self.prefix + ":nodes:alive"], args=argv, client=client))

    def _k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def close(self) -> None:
        self.client.close()
        self.bulk.close()

    # ---- clients ----------------------------------------------------------------------
    def register_client(self, record: ClientRecord, now_ms: int, stale_after_ms: int) -> bool:
        result = self._run(
            "REGISTER_CLIENT",
            record.node_id,
            now_ms,
            stale_after_ms,
            self.limits.max_clients,
            record.node_address,
            record.peer_address,
            encode_caps(record.caps),
            record.engine_desc,
            "\n".join(record.tags),
        )
        if result == -1:
            raise QuotaExceeded(
                f"the master holds {self.limits.max_clients} clients, its limit (UMBP_MASTER_MAX_CLIENTS)"
            )
        return bool(result == 1)

    def unregister_client(self, node_id: str) -> bool:
        return bool(self._run("UNREGISTER_CLIENT", node_id) == 1)

    @staticmethod
    def _record(node_id: str, fields: dict[Any, bytes]) -> ClientRecord | None:
        if not fields:
            return None
        f = {_s(k): v for k, v in fields.items()}
        tags = _s(f.get("tags", b""))
        return ClientRecord(
            node_id=node_id,
            node_address=_s(f.get("addr", b"")),
            peer_address=_s(f.get("peer", b"")),
            engine_desc=bytes(f.get("engine", b"")),
            tags=tags.split("\n") if tags else [],
            caps=decode_caps(_s(f.get("caps", b""))),
            status=ClientStatus(int(f.get("status", 0))),
            last_heartbeat_ms=int(f.get("last_hb", 0)),
            registered_at_ms=int(f.get("reg_at", 0)),
            seq=int(f.get("seq", 0)),
        )

    def get_client(self, node_id: str) -> ClientRecord | None:
        """The whole record, the engine descriptor too."""
        return self._record(node_id, self._guard(lambda: self.client.hgetall(self._k("node", node_id))))

    #: What routing reads of each node: all but the engine descriptor, which can be large.
    _LISTED = ("addr", "peer", "status", "last_hb", "reg_at", "seq", "caps", "tags")

    def list_clients(self) -> list[ClientRecord]:
        ids = sorted(_s(i) for i in self._guard(lambda: self.client.smembers(self._k("nodes", "alive"))))
        if not ids:
            return []

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for node_id in ids:
                pipe.hmget(self._k("node", node_id), self._LISTED)
            return list(pipe.execute())

        out = []
        for node_id, values in zip(ids, self._guard(fetch)):
            fields = {name: v for name, v in zip(self._LISTED, values) if v is not None}
            record = self._record(node_id, fields)
            if record is not None:
                out.append(record)
        return out

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
        args: list[object] = [
            node_id,
            first_seq,
            last_seq,
            now_ms,
            int(full_sync),
            encode_caps(caps),
            self.limits.max_keys_per_client,
            self.limits.max_keys,
        ]
        for e in events:
            args += [int(e.add), e.key, e.tier, e.size]
        status, value = self._run("APPLY_HEARTBEAT", *args)
        status = _s(status)
        if status == "QUOTA":
            raise QuotaExceeded(_s(value))
        return HeartbeatResult(HeartbeatStatus(status.lower()), int(value))

    def expire_stale_clients(self, cutoff_ms: int) -> list[str]:
        return [_s(n) for n in self._run("EXPIRE_STALE", cutoff_ms)]

    # ---- block index ------------------------------------------------------------------
    def lookup(self, keys: list[str]) -> list[list[Location]]:
        if not keys:
            return []

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(self._k("block", key))
            return list(pipe.execute())

        out = []
        for fields in self._guard(fetch):
            locs = []
            for name, size in fields.items():
                name = _s(name)
                if name.startswith("l|"):
                    _, node, tier = name.rsplit("|", 2)
                    locs.append(Location(node, int(tier), int(size)))
            out.append(locs)
        return out

    def exists(self, keys: list[str], alive: set[str]) -> list[bool]:
        if not keys:
            return []
        if not alive:
            return [False] * len(keys)
        return [bool(x) for x in self._run("EXISTS_LIVE", len(alive), *sorted(alive), *keys)]

    def touch(self, keys: list[str], now_ms: int, lease_ms: int) -> None:
        if keys:
            self._run("TOUCH", now_ms, lease_ms, *keys)

    def key_count(self) -> int:
        return int(self._guard(lambda: self.client.get(self._k("nblocks"))) or 0)

    def eviction_candidates(self, node_id: str, tier: int, limit: int, now_ms: int) -> list[tuple[str, int]]:
        flat = self._run("EVICTION_CANDIDATES", node_id, tier, limit, now_ms)
        return [(_s(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    # ---- external KV ------------------------------------------------------------------
    def report_external_kv(self, node_id: str, hashes: list[str], tier: int) -> bool:
        result = self._run("REPORT_EXTERNAL_KV", node_id, tier, self.limits.max_external_kv_per_client, *hashes)
        if result == -1:
            raise QuotaExceeded(
                f"node {node_id!r} would report more external KV hashes than its quota of "
                f"{self.limits.max_external_kv_per_client} (UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT)"
            )
        return bool(result == 1)

    def revoke_external_kv(self, node_id: str, hashes: list[str], tier: int) -> None:
        self._run("REVOKE_EXTERNAL_KV", node_id, 1 << tier, *hashes)

    def revoke_external_kv_at_tier(self, node_id: str, tier: int) -> None:
        self._run("REVOKE_EXTERNAL_KV", node_id, 1 << tier)

    def revoke_external_kv_for_node(self, node_id: str) -> None:
        self._run("REVOKE_EXTERNAL_KV", node_id, -1)

    def external_kv_count(self, node_id: str) -> int:
        return int(self._guard(lambda: self.client.scard(self._k("extkv", "node", node_id))))

    def match_external_kv(self, hashes: list[str], count_as_hit: bool, now_ms: int) -> dict[str, dict[int, list[str]]]:
        unique = list(dict.fromkeys(hashes))
        if not unique:
            return {}
        flat = self._run("MATCH_EXTERNAL_KV", int(count_as_hit), now_ms, self.limits.max_hit_entries, *unique)
        out: dict[str, dict[int, list[str]]] = {}
        for i in range(0, len(flat), 3):
            node, mask, h = _s(flat[i]), int(flat[i + 1]), _s(flat[i + 2])
            by_tier = out.setdefault(node, {})
            for tier in TIERS:
                if mask & (1 << tier):
                    by_tier.setdefault(tier, []).append(h)
        return out

    def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]:
        unique = list(dict.fromkeys(hashes))

        def fetch() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in unique:
                pipe.hget(self._k("hit", h), "c")
            return list(pipe.execute())

        return [(h, int(c)) for h, c in zip(unique, self._guard(fetch)) if c is not None]

    def gc_hits(self, cutoff_ms: int) -> int:
        dropped = 0
        pattern = self._k("hit", "*")
        cursor = 0
        while True:
            cursor, found = self._guard(lambda c=cursor: self.client.scan(c, match=pattern, count=1000))  # type: ignore[misc]
            if found:
                dropped += int(self._run("GC_HITS", cutoff_ms, *found))
            if cursor == 0:
                return dropped
