"""Setting up the remote transport (:mod:`._remote`) at init: mori-core's UCX engine
(:mod:`._remote_ucx`) where every PE can run it, else :class:`._remote.Unavailable` saying why.
Its own module, so that the interface (:mod:`._remote`) and its implementation import each other
in one direction only."""

from __future__ import annotations

from typing import Any

from mori.core.memory import LiveRanges

from ._errors import ShmemError
from ._heap import Heap
from ._reach import Reach
from ._remote import RemoteTransport, Unavailable
from ._remote_ucx import UcxTransport, why_unavailable

__all__ = ["open_remote"]


def open_remote(bootstrap: Any, heap: Heap, reach: Reach, timeout: float, live: LiveRanges) -> RemoteTransport:
    """Sets up the remote transport on every PE (collective: every PE calls it at init, after
    building its heap): mori-core's UCX engine (:mod:`._remote_ucx`) where every PE can run it.
    ``live``: the allocator's live blocks (:class:`mori.core.memory.LiveRanges`), which
    :meth:`RemoteTransport.quick_put` checks a put against.

    Raises :class:`ShmemError` on every PE, naming the hosts and why, when PEs on several hosts
    need it and some PE cannot run it; likewise for a GPU heap with ``MORI_DISABLE_P2P`` on one
    host, whose kernels would otherwise stop at their first operation on a peer (a device cannot
    raise). A CPU heap with ``MORI_DISABLE_P2P`` on one host initializes, and host calls to peers
    raise instead.
    """
    if not reach.any_remote:
        return Unavailable(reach, "no PE is remote")
    reasons: dict[str, list[int]] = {}
    for pe, reason in enumerate(bootstrap.allgather(why_unavailable(heap.kind).encode())):
        if reason:
            reasons.setdefault(reason.decode(), []).append(pe)
    missing = "; ".join(f"{r} (PEs {', '.join(map(str, pes))})" for r, pes in reasons.items())
    problem = reach.hosts_problem()
    if problem is not None and missing:
        raise ShmemError(
            f"mori.shmem reaches PEs on other hosts through its remote transport, which is not "
            f"available ({missing}): {problem}"
        )
    if heap.kind == "gpu" and missing:
        raise ShmemError(
            f"MORI_DISABLE_P2P is set, so the GPU heap reaches its peers through mori.shmem's remote "
            f"transport, which is not available ({missing}); a kernel's put to a peer would stop the "
            f"kernel. Unset MORI_DISABLE_P2P, or make the remote transport available."
        )
    if missing:
        return Unavailable(reach, missing)
    return UcxTransport(bootstrap, heap, reach, timeout, live)
