"""Routing: which peer a put goes to, which replica a get reads, whether keys exist.

The master is an advisor: it picks, the peers own the bytes. A location counts only while its
node is alive, judged at the moment of the call (last heartbeat within ``ttl * max_missed``),
so a silent peer stops being routed to when its expiry passes, before the reaper even runs.
"""

from __future__ import annotations

import dataclasses
import random

from .store import TIERS, ClientRecord, ClientStatus, Location, MetadataStore


@dataclasses.dataclass(frozen=True)
class PutRoute:
    """Where one key should be written; ``node_id`` empty when it already exists or no peer has room."""

    already_exists: bool = False
    node_id: str = ""
    tier: int = 0
    peer_address: str = ""


@dataclasses.dataclass(frozen=True)
class GetRoute:
    location: Location
    peer_address: str


class Router:
    def __init__(
        self,
        store: MetadataStore,
        expiry_ms: int,
        lease_ms: int,
        select_algo: str = "most_available",
        node_affinity: str = "none",
    ) -> None:
        self.store = store
        self.expiry_ms = expiry_ms
        self.lease_ms = lease_ms
        self.select_algo = select_algo
        self.node_affinity = node_affinity
        self._rng = random.Random()
        #: When this master started: a node's silence before it (while no master ran, for a
        #: store that outlives masters) is not held against it.
        self.since_ms = 0

    def alive_clients(self, now_ms: int) -> dict[str, ClientRecord]:
        cutoff = now_ms - self.expiry_ms
        return {
            r.node_id: r
            for r in self.store.list_clients()
            if r.status == ClientStatus.ALIVE and max(r.last_heartbeat_ms, self.since_ms) >= cutoff
        }

    # ---- gets -------------------------------------------------------------------------
    def exists(self, keys: list[str], now_ms: int) -> list[bool]:
        return self.store.exists(keys, set(self.alive_clients(now_ms)))

    def route_get(self, keys: list[str], now_ms: int, exclude: set[str]) -> list[GetRoute | None]:
        """One replica per key (the fastest tier, random among nodes there); found keys get a
        read lease so the eviction advisor leaves them alone while the reader fetches."""
        alive = self.alive_clients(now_ms)
        out: list[GetRoute | None] = []
        found: list[str] = []
        for key, locs in zip(keys, self.store.lookup(keys)):
            live = [loc for loc in locs if loc.node_id in alive and loc.node_id not in exclude]
            if not live:
                out.append(None)
                continue
            fastest = min(loc.tier for loc in live)
            loc = self._rng.choice([x for x in live if x.tier == fastest])
            out.append(GetRoute(loc, alive[loc.node_id].peer_address))
            found.append(key)
        if found:
            self.store.touch(found, now_ms, self.lease_ms)
        return out

    # ---- puts -------------------------------------------------------------------------
    def route_put(
        self, keys: list[str], sizes: list[int], requester: str, now_ms: int, exclude: set[str]
    ) -> list[PutRoute]:
        """A target per key: fastest tier first, then the node with the most projected room
        (or capacity-weighted random). Sizes routed earlier in the batch are subtracted from
        the projection, so one batch does not pile onto a node past its room."""
        alive = self.alive_clients(now_ms)
        candidates = {n: r for n, r in alive.items() if n not in exclude}
        room: dict[tuple[str, int], int] = {
            (n, t): cap.available for n, r in candidates.items() for t, cap in r.caps.items() if t in TIERS
        }
        existing = self.store.exists(keys, set(alive))
        sticky = self._same_node(keys, sizes, existing, candidates, room)
        out = []
        for key_exists, size in zip(existing, sizes):
            if key_exists:
                out.append(PutRoute(already_exists=True))
                continue
            target = self._pick(size, requester, sticky, candidates, room)
            if target is None:
                out.append(PutRoute())
                continue
            node_id, tier = target
            room[(node_id, tier)] -= size
            if self.node_affinity == "same" and sticky is None:
                sticky = node_id
            out.append(PutRoute(node_id=node_id, tier=tier, peer_address=candidates[node_id].peer_address))
        return out

    def _fits(self, record: ClientRecord, tier: int, size: int, room: dict[tuple[str, int], int]) -> bool:
        cap = record.caps.get(tier)
        if cap is None or room.get((record.node_id, tier), 0) < size:
            return False
        return cap.max_allocatable == 0 or cap.max_allocatable >= size

    def _same_node(
        self,
        keys: list[str],
        sizes: list[int],
        existing: list[bool],
        candidates: dict[str, ClientRecord],
        room: dict[tuple[str, int], int],
    ) -> str | None:
        """For affinity ``same``: one node whose fastest fitting tier takes the whole batch."""
        if self.node_affinity != "same":
            return None
        need = sum(s for s, e in zip(sizes, existing) if not e)
        for tier in TIERS:
            fits = [r for r in candidates.values() if self._fits(r, tier, need, room)]
            if fits:
                return max(fits, key=lambda r: room[(r.node_id, tier)]).node_id
        return None

    def _pick(
        self,
        size: int,
        requester: str,
        sticky: str | None,
        candidates: dict[str, ClientRecord],
        room: dict[tuple[str, int], int],
    ) -> tuple[str, int] | None:
        preferred = sticky if sticky is not None else requester if self.node_affinity == "local" else None
        for tier in TIERS:
            fits = [r for r in candidates.values() if self._fits(r, tier, size, room)]
            if not fits:
                continue
            for r in fits:
                if r.node_id == preferred:
                    return r.node_id, tier
            if self.select_algo == "random":
                weights = [room[(r.node_id, tier)] for r in fits]
                choice = self._rng.choices(fits, weights=weights)[0]
            else:
                choice = max(fits, key=lambda r: room[(r.node_id, tier)])
            return choice.node_id, tier
        return None
