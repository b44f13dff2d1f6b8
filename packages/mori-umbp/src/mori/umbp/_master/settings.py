"""The master's settings: MORI's ``UMBP_*`` environment variables, and the bounds mori adds.

Resolution follows MORI's ``runtime-env-vars.md``: an unset or empty variable gives the default
silently; a value that does not parse (``"10abc"``, ``"0x10"``, a negative number) or is below the
setting's minimum gives the default and one warning per variable per process. Values are read
once, when :meth:`MasterSettings.from_environment` runs at master start.
"""

from __future__ import annotations

import dataclasses
import os

from mori.core.log import get_logger

from .._env import runtime_int as env_int

log = get_logger("umbp.master")

_warned: set[str] = set()


def env_enum(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """One of ``allowed``; anything else gives ``default`` and one warning (MORI's ``GetEnvEnum``)."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    if raw not in allowed:
        if name not in _warned:
            _warned.add(name)
            log.warning("%s=%r is not one of %s; using the default %r", name, raw, ", ".join(allowed), default)
        return default
    return raw


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, "") or default


@dataclasses.dataclass
class MasterSettings:
    """Everything the master reads at start. Field docs name the variable that sets each one."""

    #: ``ADDRESS`` argument, else ``UMBP_MASTER_LISTEN``: where gRPC listens (``host:port``).
    listen_address: str = "0.0.0.0:50051"
    #: ``METRICS_PORT`` argument: Prometheus metrics over HTTP on this port; 0 turns it off.
    metrics_port: int = 9091
    #: ``UMBP_HEARTBEAT_TTL_SEC``: a client silent for ``ttl * max_missed`` seconds is dead.
    heartbeat_ttl_s: int = 10
    #: ``UMBP_MAX_MISSED_HEARTBEATS``.
    max_missed_heartbeats: int = 3
    #: ``UMBP_REAPER_INTERVAL_SEC``: how often the reaper looks for dead clients.
    reaper_interval_s: int = 5
    #: ``UMBP_HEARTBEAT_INTERVAL_DIVISOR``: recommended heartbeat interval = ttl / divisor.
    heartbeat_interval_divisor: int = 2
    #: ``UMBP_EVICTION_CHECK_INTERVAL_SEC``: the eviction advisor's period.
    eviction_check_interval_s: int = 5
    #: ``UMBP_LEASE_DURATION_SEC``: a key routed to a reader is not advised for eviction this long.
    lease_duration_s: int = 2
    #: ``UMBP_EVICTKEY_DEADLINE_MS``: deadline of each EvictKey call to a peer.
    evictkey_deadline_ms: int = 1000
    #: Eviction starts on a (node, tier) at this used fraction ...
    eviction_high_watermark: float = 0.9
    #: ... and asks for enough bytes to bring it down to this one.
    eviction_low_watermark: float = 0.7
    #: Keys advised per (node, tier) per eviction round.
    evict_batch_size: int = 32
    #: ``UMBP_HIT_INDEX_TTL_SEC``: a hit counter not counted for this long is dropped.
    hit_index_ttl_s: int = 7200
    #: ``UMBP_HIT_INDEX_GC_INTERVAL_SEC``.
    hit_index_gc_interval_s: int = 60
    #: ``UMBP_HIT_QUERY_MAX_BATCH``: most hashes in one GetExternalKvHitCounts.
    hit_query_max_batch: int = 4096
    #: ``UMBP_ROUTE_PUT_SELECT_ALGO``: ``most_available`` or ``random`` (capacity-weighted).
    route_put_select_algo: str = "most_available"
    #: ``UMBP_ROUTE_PUT_NODE_AFFINITY``: ``none``, ``same`` or ``local``.
    route_put_node_affinity: str = "none"
    #: ``UMBP_GRPC_SHUTDOWN_DEADLINE_SEC``: in-flight calls get this long at shutdown.
    grpc_shutdown_deadline_s: int = 3
    #: ``UMBP_MASTER_MAX_POLLERS``: gRPC handler threads.
    max_pollers: int = 64
    #: ``UMBP_METADATA_BACKEND``: ``inmemory`` or ``redis``.
    metadata_backend: str = "inmemory"
    #: ``UMBP_REDIS_URI``: ``tcp://host:port`` (or ``redis://``); a comma list for cluster seeds.
    redis_uri: str = ""
    #: ``UMBP_REDIS_NAMESPACE``: keys live under the hash tag ``{umbp:<namespace>}``.
    redis_namespace: str = "default"
    #: ``UMBP_REDIS_CLUSTER``: 1 to use redis-py's cluster client.
    redis_cluster: bool = False
    #: ``UMBP_REDIS_POOL_SIZE``: connection pool size; 0 sizes it to the handler threads.
    redis_pool_size: int = 0
    #: ``UMBP_REDIS_CONNECT_TIMEOUT_MS``.
    redis_connect_timeout_ms: int = 1000
    #: ``UMBP_REDIS_SOCKET_TIMEOUT_MS``: per-command timeout.
    redis_socket_timeout_ms: int = 1000
    #: ``UMBP_REDIS_PASSWORD``.
    redis_password: str = ""
    #: ``UMBP_MASTER_MAX_CLIENTS``: most registered clients at once.
    max_clients: int = 1024
    #: ``UMBP_MASTER_MAX_KEYS``: most distinct keys in the global block index.
    max_keys: int = 16_000_000
    #: ``UMBP_MASTER_MAX_KEYS_PER_CLIENT``: most keys one client may own in the index.
    max_keys_per_client: int = 4_000_000
    #: ``UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT``: most external-KV hashes one client may report.
    max_external_kv_per_client: int = 4_000_000
    #: ``UMBP_MASTER_MAX_HIT_ENTRIES``: most hit counters kept.
    max_hit_entries: int = 4_000_000
    #: ``UMBP_MASTER_MAX_KEY_BYTES``: longest key, hash or node id (UTF-8 bytes).
    max_key_bytes: int = 1024
    #: ``UMBP_MASTER_MAX_BLOCK_BYTES``: largest block size a put or an ADD event may name.
    max_block_bytes: int = 1 << 40
    #: ``UMBP_MASTER_MAX_BATCH``: most keys (or events) in one request.
    max_batch: int = 65536
    #: ``UMBP_MASTER_MAX_MESSAGE_BYTES``: largest gRPC message either way.
    max_message_bytes: int = 64 << 20
    #: ``UMBP_MASTER_MAX_REPORTED_SERIES``: most series kept from clients' ReportMetrics.
    max_reported_series: int = 16384

    @property
    def expiry_s(self) -> int:
        """Seconds of silence after which a client is dead: ``heartbeat_ttl * max_missed``."""
        return self.heartbeat_ttl_s * self.max_missed_heartbeats

    @property
    def heartbeat_interval_ms(self) -> int:
        return self.heartbeat_ttl_s * 1000 // self.heartbeat_interval_divisor

    @classmethod
    def from_environment(cls) -> MasterSettings:
        """The settings with every ``UMBP_*`` variable of the environment applied."""
        d = cls()
        return cls(
            listen_address=env_str("UMBP_MASTER_LISTEN", d.listen_address),
            heartbeat_ttl_s=env_int("UMBP_HEARTBEAT_TTL_SEC", d.heartbeat_ttl_s, 1),
            max_missed_heartbeats=env_int("UMBP_MAX_MISSED_HEARTBEATS", d.max_missed_heartbeats, 1),
            reaper_interval_s=env_int("UMBP_REAPER_INTERVAL_SEC", d.reaper_interval_s, 1),
            heartbeat_interval_divisor=env_int("UMBP_HEARTBEAT_INTERVAL_DIVISOR", d.heartbeat_interval_divisor, 1),
            eviction_check_interval_s=env_int("UMBP_EVICTION_CHECK_INTERVAL_SEC", d.eviction_check_interval_s, 1),
            lease_duration_s=env_int("UMBP_LEASE_DURATION_SEC", d.lease_duration_s, 1),
            evictkey_deadline_ms=env_int("UMBP_EVICTKEY_DEADLINE_MS", d.evictkey_deadline_ms, 1),
            hit_index_ttl_s=env_int("UMBP_HIT_INDEX_TTL_SEC", d.hit_index_ttl_s, 1),
            hit_index_gc_interval_s=env_int("UMBP_HIT_INDEX_GC_INTERVAL_SEC", d.hit_index_gc_interval_s, 1),
            hit_query_max_batch=env_int("UMBP_HIT_QUERY_MAX_BATCH", d.hit_query_max_batch, 1),
            route_put_select_algo=env_enum(
                "UMBP_ROUTE_PUT_SELECT_ALGO", d.route_put_select_algo, ("most_available", "random")
            ),
            route_put_node_affinity=env_enum(
                "UMBP_ROUTE_PUT_NODE_AFFINITY", d.route_put_node_affinity, ("none", "same", "local")
            ),
            grpc_shutdown_deadline_s=env_int("UMBP_GRPC_SHUTDOWN_DEADLINE_SEC", d.grpc_shutdown_deadline_s, 1),
            max_pollers=env_int("UMBP_MASTER_MAX_POLLERS", d.max_pollers, 1),
            metadata_backend=env_enum("UMBP_METADATA_BACKEND", d.metadata_backend, ("inmemory", "redis")),
            redis_uri=env_str("UMBP_REDIS_URI", d.redis_uri),
            redis_namespace=env_str("UMBP_REDIS_NAMESPACE", d.redis_namespace),
            redis_cluster=env_int("UMBP_REDIS_CLUSTER", 0, 0) != 0,
            redis_pool_size=env_int("UMBP_REDIS_POOL_SIZE", d.redis_pool_size, 0),
            redis_connect_timeout_ms=env_int("UMBP_REDIS_CONNECT_TIMEOUT_MS", d.redis_connect_timeout_ms, 1),
            redis_socket_timeout_ms=env_int("UMBP_REDIS_SOCKET_TIMEOUT_MS", d.redis_socket_timeout_ms, 1),
            redis_password=env_str("UMBP_REDIS_PASSWORD", d.redis_password),
            max_clients=env_int("UMBP_MASTER_MAX_CLIENTS", d.max_clients, 1),
            max_keys=env_int("UMBP_MASTER_MAX_KEYS", d.max_keys, 1),
            max_keys_per_client=env_int("UMBP_MASTER_MAX_KEYS_PER_CLIENT", d.max_keys_per_client, 1),
            max_external_kv_per_client=env_int(
                "UMBP_MASTER_MAX_EXTERNAL_KV_PER_CLIENT", d.max_external_kv_per_client, 1
            ),
            max_hit_entries=env_int("UMBP_MASTER_MAX_HIT_ENTRIES", d.max_hit_entries, 1),
            max_key_bytes=env_int("UMBP_MASTER_MAX_KEY_BYTES", d.max_key_bytes, 1),
            max_block_bytes=env_int("UMBP_MASTER_MAX_BLOCK_BYTES", d.max_block_bytes, 1),
            max_batch=env_int("UMBP_MASTER_MAX_BATCH", d.max_batch, 1),
            max_message_bytes=env_int("UMBP_MASTER_MAX_MESSAGE_BYTES", d.max_message_bytes, 1024),
            max_reported_series=env_int("UMBP_MASTER_MAX_REPORTED_SERIES", d.max_reported_series, 0),
        )

    def describe(self) -> str:
        """The one ``[Master] Resolved ...`` line MORI's master logs at start, and more."""
        return (
            f"heartbeat_ttl={self.heartbeat_ttl_s}s reaper_interval={self.reaper_interval_s}s "
            f"max_missed={self.max_missed_heartbeats} eviction.check_interval="
            f"{self.eviction_check_interval_s}s lease_duration={self.lease_duration_s}s "
            f"route_put={self.route_put_select_algo}/{self.route_put_node_affinity} "
            f"store={self.metadata_backend}"
        )
