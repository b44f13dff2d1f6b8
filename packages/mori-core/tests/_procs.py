"""Runs test bodies in real, separately spawned processes and always reaps them.

``run_procs(fn, [args0, args1, ...])`` starts one spawned process per argument tuple, returns
``[fn(*args0), fn(*args1), ...]`` in order, and fails with the child's traceback (or exit code)
as soon as one fails. Children still alive at the deadline or after a failure are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any


def _entry(results: Any, index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        results.put((index, True, fn(*args)))
    except BaseException:
        results.put((index, False, traceback.format_exc()))


def run_procs(fn: Callable[..., Any], arg_lists: Sequence[tuple[Any, ...]], timeout: float = 120.0) -> list[Any]:
    """Runs ``fn(*args)`` for each ``args`` in its own spawned process; returns the results in order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(results, i, fn, tuple(a)), daemon=True) for i, a in enumerate(arg_lists)]
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(out) < len(procs):
            try:
                index, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                for i, p in enumerate(procs):
                    if i not in out and p.exitcode is not None and results.empty():
                        raise AssertionError(f"process {i} died with exit code {p.exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(len(procs))) - set(out))
                    raise AssertionError(f"processes {missing} did not finish within {timeout} s") from None
                continue
            if not ok:
                raise AssertionError(f"process {index} failed:\n{value}")
            out[index] = value
        return [out[i] for i in range(len(procs))]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
