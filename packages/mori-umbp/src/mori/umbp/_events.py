"""What a node's store tells its listeners (the heartbeat's outbox): a block was added to a tier,
or removed from one. A block that moves from DRAM to SSD is an ADD on SSD then a REMOVE on DRAM,
so a reader of the events never sees it nowhere."""

from __future__ import annotations

import dataclasses
import enum

from ._enums import UMBPTierType


class KvEventType(enum.IntEnum):
    """MORI's ``KvEvent`` kinds."""

    ADD = 0
    REMOVE = 1


@dataclasses.dataclass(frozen=True, slots=True)
class KvEvent:
    """One change of where a block lives: ``key`` was added to or removed from ``tier``; ``size``
    is the block's bytes and ``depth`` the prefix depth it was put with (-1: none)."""

    type: KvEventType
    key: str
    tier: UMBPTierType
    size: int
    depth: int = -1
