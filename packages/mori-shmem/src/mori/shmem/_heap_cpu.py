"""The CPU heap: one memfd-backed host segment per PE, mapped by every PE on the host.

Used when there is no GPU or ``MORI_SHMEM_BACKEND=cpu``: every API then works between plain
processes. Copies are ``memmove`` into the mappings; atomics and waits are the native ones of
:mod:`mori.core.atomics`, which are sequentially consistent, so a signal written after a put is
seen only after the put's bytes.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from mori.core import atomics
from mori.core.codes import Cmp
from mori.core.memory import FdExchange, HostSegment

from ._heap import Heap
from ._reach import Reach

__all__ = ["CpuHeap"]


class CpuHeap(Heap):
    """Host shared-memory heap of ``size`` bytes; the peers of ``reach.mapped`` mapped."""

    kind = "cpu"

    def __init__(self, bootstrap: Any, size: int, reach: Reach) -> None:
        self.size = self.chunk = self.mapped = size  # mapped whole, at once
        self.p2p_disabled = reach.p2p_disabled
        self._segment = HostSegment.create(size)
        self._peers: list[Any] = []
        self.base = self._segment.addr
        self.peer_bases = [0] * bootstrap.world
        self.peer_bases[bootstrap.rank] = self.base
        try:
            # Collective on every PE alike (p2p_disabled is agreed); only this host's PEs send fds.
            if not reach.p2p_disabled and bootstrap.world > 1:
                with FdExchange(bootstrap) as fdx:
                    peer_fds = fdx.allgather_fds([self._segment.fd])
                for pe, fds in enumerate(peer_fds):
                    try:
                        if pe != bootstrap.rank and pe in reach.mapped:
                            peer = HostSegment.attach(fds[0], size)
                            self._peers.append(peer)
                            self.peer_bases[pe] = peer.addr
                    finally:
                        for fd in fds:
                            os.close(fd)
        except BaseException:
            self.close()
            raise

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """``memmove`` (the heap and its peers are ordinary host memory here)."""
        ctypes.memmove(dst, src, nbytes)

    def atomic(self, op: str, pe: int, offset: int, value: int, compare: int, width: int) -> int:
        """Native host atomics on the peer's shared mapping."""
        addr = self.peer_bases[pe] + offset
        if op == "fetch_add":
            return atomics.fetch_add(addr, value, width=width)
        if op == "compare_swap":
            return atomics.compare_swap(addr, compare, value, width=width)
        if op == "swap":
            return atomics.swap(addr, value, width=width)
        if op == "store":
            return atomics.swap(addr, value, width=width)
        raise ValueError(f"unknown atomic operation {op!r}")

    def wait_until(self, offset: int, cmp: Cmp, value: int, timeout: float, width: int, stores: Any = None) -> int:
        """The native wait (spins, then sleeps with back-off, without the GIL); remote PEs' writes
        land in host memory, where it sees them at once (``stores`` is not needed)."""
        return atomics.wait_until(self.base + offset, cmp, value, timeout, width=width)

    def synchronize(self) -> None:
        """Nothing to wait for: host copies and atomics are complete when they return."""

    def close(self) -> None:
        """Unmaps the peers' segments and releases this PE's."""
        for peer in self._peers:
            peer.close()
        self._peers.clear()
        self._segment.close()
