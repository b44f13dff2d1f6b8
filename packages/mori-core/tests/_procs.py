"""Runs test bodies in real, separately spawned processes and always reaps them.

``run_procs(fn, [args0, args1, ...])`` starts one spawned process per argument tuple, returns
``[fn(*args0), fn(*args1), ...]`` in order, and fails with the child's traceback (or exit code)
as soon as one fails. Children still alive at the deadline or after a failure are killed.

``ProcPool(n)`` keeps ``n`` such processes alive across calls, so one set of ranks can serve
many hypothesis examples: ``pool.map(fn, arg_lists)`` / ``pool.run(fn, *args)``. Inside a
worker, :func:`context` gives its index, the pool size, a ``state`` dict that survives between
calls (a bootstrap, say) and ``share(value)``, which hands worker 0's value to every worker
(a unique id, say) through the parent once all of them have asked: a start line, so that no
rank's timeout starts while another is still importing.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["Died", "ProcPool", "WorkerContext", "context", "run_procs"]


@dataclass
class WorkerContext:
    """What a pool worker knows about itself."""

    index: int
    size: int
    conn: Connection
    state: dict[str, Any] = field(default_factory=dict)

    def share(self, value: Any = None, root: int = 0) -> Any:
        """Every worker calls this in the same call; all get worker ``root``'s ``value``."""
        self.conn.send(("share", value if self.index == root else None, self.index == root))
        while True:
            msg = self.conn.recv()
            if msg[0] == "shared":
                return msg[1]


@dataclass(frozen=True)
class Died:
    """The result of a worker that was allowed to die (``may_die``) and did."""

    exitcode: int | None


_context: WorkerContext | None = None


def context() -> WorkerContext:
    """This worker's context; only inside a function a pool runs."""
    if _context is None:
        raise RuntimeError("_procs.context() is only available inside a ProcPool worker")
    return _context


def _worker(index: int, size: int, conn: Connection) -> None:
    global _context
    _context = WorkerContext(index, size, conn)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        if msg[0] != "call":
            continue  # the answer to a share this worker did not take part in
        _, fn, args = msg
        try:
            reply: tuple[str, Any] = ("done", fn(*args))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as exc:
            conn.send(("error", f"result of {fn.__name__} could not be sent back: {exc!r}"))


class ProcPool:
    """``n`` spawned worker processes that run functions on request, reused across calls.

    A failure, a death or a timeout in any worker kills them all and raises ``AssertionError``
    naming the worker; the pool is then closed.
    """

    def __init__(self, n: int, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._closed = False
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, args=(i, n, child), daemon=True, name=f"mori-test-{i}")
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        except BaseException:
            self.kill()
            raise

    @property
    def size(self) -> int:
        """How many workers the pool has."""
        return len(self._procs)

    def __enter__(self) -> ProcPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Runs ``fn(*args)`` in every worker; returns the results in worker order."""
        return self.map(fn, [args] * len(self._procs), timeout=timeout)

    def map(self, fn: Callable[..., Any], arg_lists: Sequence[tuple[Any, ...]], timeout: float | None = None,
            may_die: Collection[int] = ()) -> list[Any]:
        """Runs ``fn(*arg_lists[i])`` in worker i; returns the results in order.

        Workers listed in ``may_die`` may exit instead of answering: their result is :class:`Died`.
        """
        if self._closed:
            raise RuntimeError("this ProcPool is closed (an earlier call failed)")
        if len(arg_lists) != len(self._procs):
            raise ValueError(f"{len(arg_lists)} argument tuples for {len(self._procs)} workers")
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        for conn, args in zip(self._conns, arg_lists):
            conn.send(("call", fn, tuple(args)))
        out: dict[int, Any] = {}
        self._shares: list[tuple[Any, bool]] = []
        try:
            while len(out) < len(self._procs):
                pending = [c for i, c in enumerate(self._conns) if i not in out]
                ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    missing = sorted(set(range(len(self._procs))) - set(out))
                    raise AssertionError(f"processes {missing} did not finish within {limit} s")
                for conn in ready:
                    self._take(self._conns.index(conn), out, may_die)  # type: ignore[arg-type]
        except BaseException:
            self.kill()
            raise
        return [out[i] for i in range(len(self._procs))]

    def _take(self, i: int, out: dict[int, Any], may_die: Collection[int]) -> None:
        try:
            kind, value, *rest = self._conns[i].recv()
        except (EOFError, OSError):
            self._procs[i].join(timeout=5)
            if i in may_die:
                out[i] = Died(self._procs[i].exitcode)
                return
            raise AssertionError(f"process {i} died with exit code {self._procs[i].exitcode} before reporting") from None
        if kind == "share":
            self._shares.append((value, rest[0]))
            if len(self._shares) == len(self._procs) - len(out):
                shared = [v for v, from_root in self._shares if from_root]
                if len(shared) != 1:
                    raise AssertionError(f"share(): {len(shared)} workers said they were the root, expected 1")
                for j, conn in enumerate(self._conns):
                    if j not in out:
                        conn.send(("shared", shared[0]))
                self._shares = []
        elif kind == "error":
            raise AssertionError(f"process {i} failed:\n{value}")
        else:
            out[i] = value

    def close(self) -> None:
        """Asks the workers to stop, then kills any that do not within 5 s."""
        if self._closed:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + 5
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kills every worker still alive and closes the pipes."""
        self._closed = True
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        for conn in self._conns:
            conn.close()


def run_procs(fn: Callable[..., Any], arg_lists: Sequence[tuple[Any, ...]], timeout: float = 120.0) -> list[Any]:
    """Runs ``fn(*args)`` for each ``args`` in its own spawned process; returns the results in order."""
    with ProcPool(len(arg_lists), timeout=timeout) as pool:
        return pool.map(fn, arg_lists)
