"""How this PE reaches each PE: by P2P (the peer's heap mapped here) or through the remote transport.

PEs on this host (:mod:`mori.core.host`'s one identity: one machine, one network namespace) pass
their heaps to each other as file descriptors and reach them with loads, stores and copies.
Every other PE, and with ``MORI_DISABLE_P2P`` every PE but this one (as in MORI, where it means
"reach peers over RDMA"), is reached through the remote transport (:mod:`._remote`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mori.core.host import HostIdentity, one_host_error

__all__ = ["Reach"]


@dataclass(frozen=True)
class Reach:
    """Where every PE runs, seen from PE ``rank``; ``p2p_disabled`` is ``MORI_DISABLE_P2P``."""

    rank: int
    hosts: tuple[HostIdentity, ...]
    p2p_disabled: bool

    @classmethod
    def of(cls, rank: int, hosts: Sequence[HostIdentity], p2p_disabled: bool) -> Reach:
        """The reach of PE ``rank`` given every PE's host (indexed by PE)."""
        return cls(rank, tuple(hosts), p2p_disabled)

    @property
    def world(self) -> int:
        """The number of PEs."""
        return len(self.hosts)

    def is_remote(self, pe: int) -> bool:
        """Whether ``pe`` is reached through the remote transport (never this PE itself)."""
        return pe != self.rank and (self.p2p_disabled or self.hosts[pe] != self.hosts[self.rank])

    @property
    def mapped(self) -> tuple[int, ...]:
        """The PEs whose heaps this PE maps (itself included)."""
        return tuple(pe for pe in range(self.world) if not self.is_remote(pe))

    @property
    def remote(self) -> tuple[int, ...]:
        """The PEs this PE reaches through the remote transport."""
        return tuple(pe for pe in range(self.world) if self.is_remote(pe))

    @property
    def any_remote(self) -> bool:
        """Whether some PE of the job reaches some other PE remotely (the same on every PE)."""
        return self.world > 1 and (self.p2p_disabled or len(set(self.hosts)) > 1)

    def hosts_problem(self) -> str | None:
        """Why the PEs are not all on one host (naming the groups), or None when they are."""
        return one_host_error(self.hosts, "PE")

    def why_remote(self, pe: int) -> str:
        """Why ``pe`` is reached remotely, for messages."""
        if self.hosts[pe] != self.hosts[self.rank]:
            return f"PE {pe} runs on another host ({self.hosts[pe].key})"
        return "MORI_DISABLE_P2P is set"
