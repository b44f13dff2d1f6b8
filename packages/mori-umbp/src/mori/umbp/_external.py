"""What a query of the master's external-KV index answers: which nodes hold which of the asked
hashes at which tier, and how often a hash was routed to."""

from __future__ import annotations

import dataclasses

from ._enums import UMBPTierType


@dataclasses.dataclass(slots=True)
class UMBPExternalKvMatch:
    """One node's matches: ``hashes_by_tier`` maps each tier to the asked hashes the node holds
    there (a hash may be on several tiers)."""

    node_id: str = ""
    peer_address: str = ""
    hashes_by_tier: dict[UMBPTierType, list[str]] = dataclasses.field(default_factory=dict)

    def matched_hash_count(self) -> int:
        """Distinct hashes matched on this node, over all its tiers."""
        return len({h for hashes in self.hashes_by_tier.values() for h in hashes})


@dataclasses.dataclass(slots=True)
class UMBPExternalKvHitCountEntry:
    """How many routing queries (``count_as_hit=True``) matched ``hash``."""

    hash: str = ""
    hit_count_total: int = 0
