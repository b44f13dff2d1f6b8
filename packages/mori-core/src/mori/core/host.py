"""Which processes share a host, defined once for every mori package.

Two processes are on one *machine* when they run on the same kernel (equal boot ids; the host
name stands in where ``/proc`` has no boot id). Processes on one machine share GPUs, shared
memory and CUDA IPC. They can also reach each other's *abstract* Unix sockets, which is how mori
passes file descriptors (heap chunks, VMM exports), only inside one network namespace. So
:attr:`HostIdentity.key` includes the namespace: equal keys mean "can pass fds to each other",
and :meth:`HostIdentity.same_machine` without the namespace tells a caller why two keys differ.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from collections.abc import Sequence

__all__ = ["HostIdentity", "one_host_error", "this_host"]


@dataclasses.dataclass(frozen=True)
class HostIdentity:
    """The machine and network namespace a process runs in."""

    #: ``/proc/sys/kernel/random/boot_id`` (the running kernel), else the host name.
    machine: str
    #: Inode of ``/proc/self/ns/net``; 0 where it cannot be read.
    netns: int

    @property
    def key(self) -> str:
        """``machine/netns``: equal keys mean the processes can pass fds over abstract Unix sockets."""
        return f"{self.machine}/{self.netns}"

    @classmethod
    def from_key(cls, key: str) -> HostIdentity:
        """The inverse of :attr:`key`; :class:`ValueError` naming the text if it is not one."""
        machine, sep, netns = key.rpartition("/")
        if not sep or not machine or not netns.isdigit():
            raise ValueError(f"host identity {key!r} is not 'machine/netns'")
        return cls(machine, int(netns))

    def same_machine(self, other: HostIdentity) -> bool:
        """Whether ``other`` runs on this kernel (in any network namespace)."""
        return self.machine == other.machine


@functools.lru_cache(maxsize=1)
def this_host() -> HostIdentity:
    """This process's :class:`HostIdentity` (read once)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = ""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return HostIdentity(machine or socket.gethostname(), netns)


def one_host_error(hosts: Sequence[HostIdentity], what: str = "rank") -> str | None:
    """Why ``hosts`` (indexed by rank) are not all one machine in one network namespace, or None.

    The message names the ranks of each group, and says whether they differ by machine or only
    by network namespace (then: run them in one namespace, e.g. containers with host networking).
    """
    groups: dict[HostIdentity, list[int]] = {}
    for rank, host in enumerate(hosts):
        groups.setdefault(host, []).append(rank)
    if len(groups) <= 1:
        return None
    listing = "; ".join(f"{what}s {', '.join(map(str, ranks))} on {host.key}" for host, ranks in groups.items())
    first = hosts[0]
    if all(first.same_machine(h) for h in hosts):
        return (
            f"the {what}s run on one machine but in {len(groups)} network namespaces ({listing}): they pass "
            "memory to each other over abstract Unix sockets, which do not cross namespaces; run them in "
            "one network namespace (containers: host networking, or one shared namespace)"
        )
    return f"the {what}s run on {len({h.machine for h in hosts})} machines ({listing})"
