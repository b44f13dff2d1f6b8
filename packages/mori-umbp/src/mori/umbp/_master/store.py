"""The metadata store interface: what the master keeps, behind one small seam.

Two implementations: :class:`~.memory_store.InMemoryStore` (the default, one process) and
:class:`~.redis_store.RedisStore` (MORI's key layout on Redis; a restarted master reads its index
back). Both apply every mutation whole or not at all: a call that would break a bound raises
:class:`QuotaExceeded` and changes nothing. Times are wall-clock milliseconds since the epoch,
passed in by the caller, so that a Redis store's records mean the same to a restarted master.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import NamedTuple

#: Tiers a block or an external-KV hash may live on (``umbp.TierType``), fastest first.
TIERS = (1, 2, 3)
TIER_NAMES = {0: "unknown", 1: "hbm", 2: "dram", 3: "ssd"}


class QuotaExceeded(Exception):
    """A mutation would grow a bounded index past its limit; nothing was changed."""


class StoreUnavailable(Exception):
    """The store cannot be reached (Redis down or timing out)."""


class ClientStatus(enum.IntEnum):
    UNKNOWN = 0
    ALIVE = 1
    EXPIRED = 2


@dataclasses.dataclass
class TierCapacity:
    total: int
    available: int
    max_allocatable: int = 0


@dataclasses.dataclass
class ClientRecord:
    node_id: str
    node_address: str
    peer_address: str
    engine_desc: bytes
    tags: list[str]
    caps: dict[int, TierCapacity]
    status: ClientStatus = ClientStatus.ALIVE
    last_heartbeat_ms: int = 0
    registered_at_ms: int = 0
    seq: int = 0


class Location(NamedTuple):
    """Where a key is held (a tuple: the master builds one per key of every lookup, and a frozen
    dataclass took three times as long to make)."""

    node_id: str
    tier: int
    size: int


@dataclasses.dataclass(frozen=True)
class KvEvent:
    add: bool  # ADD (True) or REMOVE (False)
    key: str
    tier: int
    size: int = 0


class HeartbeatStatus(enum.Enum):
    APPLIED = "applied"
    SEQ_GAP = "seq_gap"
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class HeartbeatResult:
    status: HeartbeatStatus
    acked_seq: int


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds a store enforces (see :class:`~.settings.MasterSettings`)."""

    max_clients: int
    max_keys: int
    max_keys_per_client: int
    max_external_kv_per_client: int
    max_hit_entries: int


class MetadataStore(abc.ABC):
    """Client records, the global block index, the external-KV index and the hit counters."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits

    # ---- clients ----------------------------------------------------------------------
    @abc.abstractmethod
    def register_client(self, record: ClientRecord, now_ms: int, stale_after_ms: int) -> bool:
        """Adds or revives ``record``; False when the node is alive and not stale (MORI's
        ALREADY_EXISTS). A revived node starts with no blocks. Raises QuotaExceeded when
        ``max_clients`` are registered already."""

    @abc.abstractmethod
    def unregister_client(self, node_id: str) -> bool:
        """Removes the node with its blocks and external-KV hashes; False if it was unknown."""

    @abc.abstractmethod
    def get_client(self, node_id: str) -> ClientRecord | None: ...

    @abc.abstractmethod
    def list_clients(self) -> list[ClientRecord]:
        """Every registered record, alive or expired-but-not-yet-reaped (``engine_desc`` may be
        left empty: routing does not read it; :meth:`get_client` has it)."""

    @abc.abstractmethod
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
        """Bundles ``first_seq..last_seq`` (consecutive), as one change. Delta (``full_sync``
        False): applied when ``first_seq == last + 1``, else a SEQ_GAP that still refreshes
        liveness (``first_seq`` 0 with no events is a keepalive). Full sync: the node's blocks
        become exactly the ADDs, and its cursor becomes ``last_seq``. Empty ``caps`` keep the
        node's last capacities."""

    @abc.abstractmethod
    def expire_stale_clients(self, cutoff_ms: int) -> list[str]:
        """Removes every client whose last heartbeat is before ``cutoff_ms``, with its blocks
        and external-KV hashes; returns their ids."""

    # ---- block index ------------------------------------------------------------------
    @abc.abstractmethod
    def lookup(self, keys: list[str]) -> list[list[Location]]:
        """Every location of each key (no lease, no access bump)."""

    @abc.abstractmethod
    def exists(self, keys: list[str], alive: set[str]) -> list[bool]:
        """Whether a node of ``alive`` holds each key: the hot path of ``batch_exists``, without
        building locations."""

    @abc.abstractmethod
    def touch(self, keys: list[str], now_ms: int, lease_ms: int) -> None:
        """Marks keys as read now: a lease until ``now + lease_ms`` and an access bump (LRU)."""

    @abc.abstractmethod
    def key_count(self) -> int: ...

    @abc.abstractmethod
    def eviction_candidates(self, node_id: str, tier: int, limit: int, now_ms: int) -> list[tuple[str, int]]:
        """Up to ``limit`` (key, size) of the node's blocks on ``tier``, least recently
        accessed first, skipping keys whose lease has not run out."""

    # ---- external KV ------------------------------------------------------------------
    @abc.abstractmethod
    def report_external_kv(self, node_id: str, hashes: list[str], tier: int) -> bool:
        """Adds the hashes at ``tier`` for an alive node; False (nothing done) when it is not
        registered. Raises QuotaExceeded past ``max_external_kv_per_client``."""

    @abc.abstractmethod
    def revoke_external_kv(self, node_id: str, hashes: list[str], tier: int) -> None: ...

    @abc.abstractmethod
    def revoke_external_kv_at_tier(self, node_id: str, tier: int) -> None: ...

    @abc.abstractmethod
    def revoke_external_kv_for_node(self, node_id: str) -> None: ...

    @abc.abstractmethod
    def external_kv_count(self, node_id: str) -> int: ...

    @abc.abstractmethod
    def match_external_kv(self, hashes: list[str], count_as_hit: bool, now_ms: int) -> dict[str, dict[int, list[str]]]:
        """node -> tier -> matched hashes (in query order). With ``count_as_hit`` each unique
        matched hash's counter goes up by one (new counters only while fewer than
        ``max_hit_entries`` exist)."""

    @abc.abstractmethod
    def hit_counts(self, hashes: list[str]) -> list[tuple[str, int]]:
        """(hash, count) for the distinct hashes that have a counter."""

    @abc.abstractmethod
    def gc_hits(self, cutoff_ms: int) -> int:
        """Drops counters not counted since ``cutoff_ms``; returns how many."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections."""
