"""A pool of real PE processes for tests: started once, then made to run functions collectively.

``PePool(n, env)`` spawns ``n`` processes (multiprocessing spawn context). Rank 0 makes the unique
id, every PE calls ``shmem_init_attr`` and then waits for work: ``pool.run(fn, *args)`` sends a
module-level function to every PE and returns the list of results indexed by rank. Every wait
has a timeout; a PE that fails or hangs fails the call and ``close()`` always reaps the processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import traceback
from typing import Any

__all__ = ["PeError", "PePool"]


class PeError(RuntimeError):
    """A function raised on one of the PEs (message carries rank and traceback)."""


def _worker(rank: int, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # report everything, the parent decides
            conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


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


class PePool:
    """``n`` PE processes; ``init=True`` initializes shmem on them at start."""

    def __init__(self, n: int, env: dict[str, str] | None = None, init: bool = True, timeout: float = 60.0):
        self.n, self.timeout = n, timeout
        ctx = mp.get_context("spawn")
        self._conns = []
        self._procs = []
        try:
            for rank in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(rank, dict(env or {}), child), daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            if init:
                self.init()
        except BaseException:
            self.close()
            raise

    def init(self) -> None:
        """Collective shmem init on every PE with a fresh unique id."""
        uid = self.run_on(0, make_uid)
        self.run_each(init_pe, [(r, self.n, uid) for r in range(self.n)])

    def run_on(self, rank: int, fn: Any, *args: Any) -> Any:
        """Runs ``fn(*args)`` on one PE."""
        self._conns[rank].send((fn, args))
        return self._collect([rank])[0]

    def run(self, fn: Any, *args: Any) -> list[Any]:
        """Runs ``fn(*args)`` on every PE at once; returns the results by rank."""
        return self.run_each(fn, [args] * self.n)

    def run_each(self, fn: Any, per_rank: list[tuple[Any, ...]]) -> list[Any]:
        """Runs ``fn(*per_rank[r])`` on PE r, all at once; returns the results by rank."""
        for conn, args in zip(self._conns, per_rank):
            conn.send((fn, args))
        return self._collect(list(range(self.n)))

    def _collect(self, ranks: list[int]) -> list[Any]:
        results, errors = [], []
        for r in ranks:
            if not self._conns[r].poll(self.timeout):
                self.close()
                raise TimeoutError(f"PE {r} did not answer within {self.timeout} s; pool stopped")
            status, value = self._conns[r].recv()
            if status == "err":
                errors.append(f"PE {r}: {value}")
            results.append(value)
        if errors:
            raise PeError("\n".join(errors))
        return results

    def close(self) -> None:
        """Stops every PE (politely, then by force)."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        for conn in self._conns:
            conn.close()
        self._conns.clear()
        self._procs.clear()
