"""A pool of real PE processes for tests: mori.core.testing's ProcPool, with shmem initialized.

``PePool(n, env)`` spawns ``n`` processes with ``env`` in their environment; ``netns[r]`` names
the network namespace PE r starts in (``mori.core.testing.network_namespaces``; None: this one). Rank 0 makes the
unique id, every PE calls ``shmem_init_attr`` and then waits for work: ``pool.run(fn, *args)``
sends a module-level function to every PE and returns the list of results indexed by rank. A
function that raises on some PEs raises :class:`PeError` naming them once all answered, and the
pool stays usable; a PE that dies or hangs stops the pool, and ``close()`` always reaps it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mori.core.testing import ProcPool, WorkerError, start_in_netns

__all__ = ["PeError", "PePool"]

#: A function raised on some PEs (the message names each as ``PE r: Type: message`` with its traceback).
PeError = WorkerError


def init_pe(rank: int, world: int, uid: bytes) -> int:
    """Initializes shmem on this PE (sent to every PE by PePool)."""
    import mori.shmem as shmem

    return shmem.shmem_init_attr(shmem.MORI_SHMEM_INIT_WITH_UNIQUEID, rank, world, uid)


def set_env(name: str, value: str) -> None:
    """Sets one environment variable in a PE."""
    os.environ[name] = value


def make_uid() -> bytes:
    """Rank 0's unique id (made in rank 0's process, which keeps the listening socket)."""
    import mori.shmem as shmem

    return shmem.shmem_get_unique_id()


class PePool(ProcPool):
    """``n`` PE processes; ``init=True`` initializes shmem on them at start."""

    def __init__(
        self,
        n: int,
        env: dict[str, str] | None = None,
        init: bool = True,
        timeout: float = 60.0,
        netns: Sequence[str | None] | None = None,
    ):
        starts = iter([start_in_netns(ns) for ns in netns] if netns is not None else [])
        super().__init__(
            n,
            timeout=timeout,
            env=env,
            label="PE",
            keep_on_error=True,
            start=(lambda proc: next(starts)(proc)) if netns is not None else None,
        )
        self.n = n
        if init:
            try:
                self.init()
            except BaseException:
                self.close()
                raise

    def init(self) -> None:
        """Collective shmem init on every PE with a fresh unique id."""
        uid = self.run_on(0, make_uid)
        self.run_each(init_pe, [(r, self.n, uid) for r in range(self.n)])

    #: ``run_each(fn, per_rank)`` runs ``fn(*per_rank[r])`` on PE r, all at once (the name the tests use).
    run_each = ProcPool.map
