"""The benchmark's points, run the same way on every system: what is timed, how it is checked,
and the wire between a node process and the driver.

Imports nothing from mori: the peer's node process (``_mooncake_node.py``) runs it under another
interpreter (``--peer-python``), where mori is not installed. A system is an adapter with
``register(ptr, size)``, ``put(keys, ptrs, sizes)``, ``get(keys, ptrs, sizes)`` (each a list
of per-key successes), ``exists(keys)`` (a list of bools), ``ssd`` (whether it has an SSD
tier the benchmark can put pages on) and ``to_ssd(keys)`` (leaves ``keys`` on that tier only,
untimed; answers how many are there and nowhere else). :func:`ask_storage_node_to_ssd` is mori's
way: the storage node moves them, asked through the driver.

The points come in two groups, :data:`GROUPS`: ``memory`` (puts, gets and batch_exists, which
the storage node serves from its memory) and ``ssd`` (gets of pages on its SSD tier only).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

MARK = "@@umbp-bench "  # the systems' libraries log to stdout too: the wire's lines carry this mark
EXISTS_PAGE = 4096
VISIBLE_TIMEOUT_S = 30.0  # the pages batch_exists asks about (their size does not matter to it)
GROUPS = ("memory", "ssd")


class System(Protocol):
    ssd: bool

    def register(self, ptr: int, size: int) -> None: ...
    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]: ...
    def exists(self, keys: list[str]) -> list[bool]: ...
    def to_ssd(self, keys: list[str]) -> int: ...


def send(obj: Any) -> None:
    """One message to the driver, on stdout."""
    print(MARK + json.dumps(obj), flush=True)


def receive() -> Any:
    """The driver's next message, on stdin (one JSON line); None when stdin closed."""
    line = sys.stdin.readline()
    return json.loads(line) if line else None


def ask_storage_node_to_ssd(keys: list[str]) -> int:
    """Asks the storage node (through the driver) to leave ``keys`` on its SSD tier only; how
    many it did."""
    send({"ask": "to_ssd", "keys": keys})
    reply = receive()
    if not reply or not isinstance(reply.get("moved"), int):
        raise RuntimeError(f"the storage node's answer to a move to SSD: {reply}")
    return int(reply["moved"])


def capacity_needed(sizes: list[int], pages: int, iters: int, warmup: int, exists_keys: int) -> int:
    """The bytes a storage node holds at the end of a run: every put iteration's pages, the
    exists pages and the SSD pages of every page size."""
    return sum((warmup + iters + 1) * pages * size for size in sizes) + exists_keys * EXISTS_PAGE


class Pages:
    """``count`` pages of ``size`` bytes in one registered buffer; each page's first 16 bytes carry
    a stamp (``tag``, page index), so a page read back under another key never checks out."""

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count, self.size = count, size
        self.base = np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)
        self.data = self.base.copy()
        self.addr = int(self.data.ctypes.data)

    def ptrs(self, count: int | None = None) -> list[int]:
        return [self.addr + i * self.size for i in range(self.count if count is None else count)]

    def expected(self, tag: int) -> np.ndarray:
        out = self.base.copy()
        out[:, :8] = np.frombuffer(np.int64(tag).tobytes(), dtype=np.uint8)
        out[:, 8:16] = np.arange(self.count, dtype=np.int64).view(np.uint8).reshape(self.count, 8)
        return out

    def stamp(self, tag: int) -> None:
        self.data[:] = self.expected(tag)


def _timed(fn: Callable[[], list[Any]], what: str) -> int:
    """Nanoseconds ``fn`` took; fails unless every key succeeded."""
    t0 = time.perf_counter_ns()
    results = fn()
    took = time.perf_counter_ns() - t0
    if not all(results):
        bad = [i for i, ok in enumerate(results) if not ok]
        raise RuntimeError(f"{what}: {len(bad)} of {len(results)} keys failed (first: {bad[:5]})")
    return took


def _row(point: str, pages: int, size: int, samples: list[int]) -> dict[str, Any]:
    median_ns = statistics.median(samples)
    return {
        "point": point,
        "pages": pages,
        "size": size,
        "iters": len(samples),
        "median_us": median_ns / 1e3,
        "gbps": pages * size / median_ns if size else None,
        "min_us": min(samples) / 1e3,
    }


def _wait_visible(system: System, keys: list[str], timeout: float = VISIBLE_TIMEOUT_S) -> None:
    """Until every key is visible to the client (a mori put is in the master's index once the
    storage node's heartbeat, sent at once on commit, has carried it there)."""
    deadline = time.monotonic() + timeout
    while not all(system.exists(keys)):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{sum(not x for x in system.exists(keys))} of {len(keys)} keys put are not visible after {timeout} s"
            )
        time.sleep(0.005)


def _check(got: np.ndarray, want: np.ndarray, what: str) -> None:
    if not np.array_equal(got, want):
        bad = np.flatnonzero((got != want).any(axis=1))
        raise RuntimeError(f"{what}: pages {bad[:5].tolist()} ({len(bad)} in all) differ from what was put")


def _samples(
    call: Callable[[], list[Any]], what: str, iters: int, warmup: int, before: Callable[[int], None] | None = None
) -> list[int]:
    """``call`` ``warmup + iters`` times (``before(i)`` untimed ahead of each); the timed ones' ns."""
    samples = []
    for it in range(warmup + iters):
        if before is not None:
            before(it)
        took = _timed(call, what)
        if it >= warmup:
            samples.append(took)
    return samples


def _pages(system: System, size: int, pages: int) -> tuple[Pages, Pages, list[int]]:
    """A source and a destination of ``pages`` pages of ``size``, registered, and their lengths."""
    src, dst = Pages(pages, size, seed=size), Pages(pages, size, seed=size + 1)
    system.register(src.addr, src.data.nbytes)
    system.register(dst.addr, dst.data.nbytes)
    return src, dst, [size] * pages


def _keys(name: str, size: int, tag: str, pages: int) -> list[str]:
    return [f"{name}-{size}-{tag}-{j}" for j in range(pages)]


def _memory_points(system: System, name: str, size: int, pages: int, iters: int, warmup: int) -> list[dict[str, Any]]:
    """Put and get of ``pages`` pages of ``size``."""
    src, dst, lengths = _pages(system, size, pages)
    label = f"{pages} × {_human(size)}"
    rows = []
    # batch put: new keys each iteration (a stored key is a no-op in both systems)
    iteration = [0]

    def next_put(it: int) -> None:
        iteration[0] = it
        src.stamp(it)

    def put() -> list[bool]:
        return system.put(_keys(name, size, f"put{iteration[0]}", pages), src.ptrs(), lengths)

    rows.append(_row(f"put {label}", pages, size, _samples(put, f"put {label}", iters, warmup, next_put)))
    last = warmup + iters - 1
    last_keys = _keys(name, size, f"put{last}", pages)
    _wait_visible(system, last_keys)
    dst.data[:] = 0
    _timed(functools.partial(system.get, last_keys, dst.ptrs(), lengths), f"get {label} (check)")
    _check(dst.data, src.expected(last), f"put {label}")

    # batch get: the first put iteration's pages, again and again
    dst.data[:] = 0
    get = functools.partial(system.get, _keys(name, size, "put0", pages), dst.ptrs(), lengths)
    rows.append(_row(f"get {label}", pages, size, _samples(get, f"get {label}", iters, warmup)))
    _check(dst.data, src.expected(0), f"get {label}")
    return rows


def _ssd_points(system: System, name: str, size: int, pages: int, iters: int, warmup: int) -> list[dict[str, Any]]:
    """Gets that hit SSD: one page and a batch of ``pages``, each left on SSD only before each get."""
    src, dst, lengths = _pages(system, size, pages)
    src.stamp(-1)
    ssd_keys = _keys(name, size, "ssd", pages)
    _timed(functools.partial(system.put, ssd_keys, src.ptrs(), lengths), "put (SSD pages)")
    _wait_visible(system, ssd_keys)
    rows = []
    for count in (1, pages):
        point = f"SSD get {count} × {_human(size)}"
        dst.data[:] = 0
        get = functools.partial(system.get, ssd_keys[:count], dst.ptrs(count), lengths[:count])
        samples = _samples(get, point, iters, warmup, functools.partial(_to_ssd_each, system, ssd_keys[:count]))
        _check(dst.data[:count], src.expected(-1)[:count], point)
        rows.append(_row(point, count, size, samples))
    return rows


def _to_ssd_each(system: System, keys: list[str], _iteration: int) -> None:
    moved = system.to_ssd(keys)
    if moved != len(keys):
        raise RuntimeError(f"{moved} of {len(keys)} pages are on the storage node's SSD only")


def _exists_point(system: System, name: str, pages: int, iters: int, warmup: int, count: int) -> dict[str, Any]:
    """``batch_exists`` of ``count`` keys, all stored (put in batches of ``pages`` beforehand)."""
    held = Pages(pages, EXISTS_PAGE, seed=7)
    system.register(held.addr, held.data.nbytes)
    names = [f"{name}-exists-{i}" for i in range(count)]
    for start in range(0, count, pages):
        chunk = names[start : start + pages]
        _timed(
            functools.partial(system.put, chunk, held.ptrs(len(chunk)), [EXISTS_PAGE] * len(chunk)),
            "put (exists pages)",
        )
    _wait_visible(system, names)
    what = f"batch_exists {count}"
    return _row(
        f"batch_exists {count} keys", count, 0, _samples(functools.partial(system.exists, names), what, iters, warmup)
    )


def run(system: System, name: str, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The points of ``plan["groups"]`` (of :data:`GROUPS`; ``ssd`` only where ``system.ssd``)
    on ``system``, in order, at the plan's ``sizes``, ``pages``, ``iters``, ``warmup`` and
    ``exists_keys``; each row is also sent to the driver as it is done."""
    sizes, pages, iters, warmup = plan["sizes"], plan["pages"], plan["iters"], plan["warmup"]
    groups = plan["groups"]
    if unknown := set(groups) - set(GROUPS):
        raise ValueError(f"point groups {sorted(unknown)}: not among {GROUPS}")
    rows: list[dict[str, Any]] = []
    for size in sizes:
        done = len(rows)
        if "memory" in groups:
            rows += _memory_points(system, name, size, pages, iters, warmup)
        if "ssd" in groups and system.ssd:
            rows += _ssd_points(system, name, size, pages, iters, warmup)
        for row in rows[done:]:
            send({"row": row})
    if "memory" in groups:
        rows.append(_exists_point(system, name, pages, iters, warmup, plan["exists_keys"]))
        send({"row": rows[-1]})
    return rows


def _human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size >> 10} KiB"
