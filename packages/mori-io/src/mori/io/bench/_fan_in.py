"""``mori-io-bench --fan-in N``: one target serving N initiator processes at once, against the
same target serving one. Each of the N initiators moves its own share of the target's memory
(one transfer of the point: size x batch bytes) with back-to-back transfers; the one initiator
moves all N shares in turn. Every initiator holds a buffer of N shares and moves share k of it to
or from the target's share k, so that both runs touch as much memory, of the same kind (on one
host a single share of a few MiB stays in the CPU's cache, N of them do not, and a larger buffer
gets huge pages: the comparison is of the target's serving, not of caches and page sizes). The aggregate is every initiator's
bytes over the time from the first one's start to the last one's end (CLOCK_MONOTONIC, one clock
for the whole host). With a target namespace the target serves from it, on its own address, and
the initiators reach it across the namespaces, as from another host."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

from mori.core.testing import start_in_netns

from .. import (
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
)
from ._measure import block_layout, pin_target
from ._mori_runner import _buffer, _create_backend

__all__ = ["run_fan_in"]

START_TIMEOUT = 120.0  # seconds for processes to start, connect and warm up


def _target(
    conn: Any, host: str, size: int, config: TcpBackendConfig | RdmaBackendConfig, backend: str, initiators: int
) -> None:
    pin_target()
    buf, addr, device, loc = _buffer(size, "cpu", "target")
    engine = IOEngine("fan-in-target", IOEngineConfig(host=host, port=0))
    _create_backend(engine, backend, config)
    mem = engine.register_memory(addr, size, device, loc)
    conn.send((engine.get_engine_desc().pack(), mem.pack()))
    try:
        for _ in range(initiators):
            engine.register_remote_engine(EngineDesc.unpack(conn.recv()))
        conn.send("ready")
        conn.recv()  # stop
    finally:
        engine.close()


def _initiator(
    conn: Any,
    rank: int,
    host: str,
    target: tuple[bytes, bytes],
    point: tuple[int, int],
    op: str,
    iters: int,
    warmup: int,
    config: TcpBackendConfig | RdmaBackendConfig,
    backend: str,
    shares: int,
    total: int,
) -> None:
    """One initiator: connected and warmed up, waits for "go", then times ``iters`` transfers
    and sends (start, end, bytes). Its transfers move shares ``rank`` to ``rank + shares - 1`` in
    turn, each between the same share of its buffer (``total`` shares) and of the target."""
    size, batch = point
    share = size * batch
    buf, addr, device, loc = _buffer(share * total, "cpu", "initiator")
    engine = IOEngine(f"fan-in-{rank}", IOEngineConfig(host=host, port=0))
    try:
        _create_backend(engine, backend, config)
        engine.register_remote_engine(EngineDesc.unpack(target[0]))
        conn.send(engine.get_engine_desc().pack())
        conn.recv()  # the target knows this engine
        rmem = MemoryDesc.unpack(target[1])
        lmem = engine.register_memory(addr, share * total, device, loc)
        l_offs, r_offs = block_layout(size, batch)
        layouts = [
            ([k * share + o for o in l_offs], [k * share + o for o in r_offs]) for k in range(rank, rank + shares)
        ]
        go = engine.batch_read if op == "read" else engine.batch_write

        def run(count: int) -> None:
            for i in range(count):
                local, remote = layouts[i % shares]
                st = go(lmem, local, rmem, remote, [size] * batch, engine.allocate_transfer_uid())
                if st.WaitFor(60_000) != StatusCode.SUCCESS:
                    raise RuntimeError(f"fan-in initiator {rank}: transfer failed: {st}")

        run(warmup)
        conn.send("warm")
        conn.recv()  # go
        t0 = time.monotonic()
        run(iters)
        conn.send((t0, time.monotonic(), share * iters))
    finally:
        engine.close()


def _recv(conn: Any, proc: mp.process.BaseProcess, what: str, timeout: float = START_TIMEOUT) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"fan-in {what} exited (code {proc.exitcode})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"fan-in {what} did not answer in {timeout:.0f} s")
    return conn.recv()


def _aggregate(
    initiators: int,
    point: tuple[int, int],
    op: str,
    iters: int,
    warmup: int,
    host: str,
    config: TcpBackendConfig | RdmaBackendConfig,
    backend: str,
    shares: int,
    target_host: str,
    target_netns: str | None,
) -> float:
    """GB/s that ``initiators`` processes move together through one target of ``shares`` shares
    at ``point`` (one initiator: every share in turn)."""
    ctx = mp.get_context("spawn")
    size, batch = point
    t_conn, t_child = ctx.Pipe()
    target = ctx.Process(
        target=_target, args=(t_child, target_host, size * batch * shares, config, backend, initiators), daemon=True
    )
    start_in_netns(target_netns)(target)
    procs: list[tuple[Any, mp.process.BaseProcess]] = []
    try:
        t_desc = _recv(t_conn, target, "target")
        for rank in range(initiators):
            conn, child = ctx.Pipe()
            proc = ctx.Process(
                target=_initiator,
                args=(
                    child,
                    rank,
                    host,
                    t_desc,
                    point,
                    op,
                    iters,
                    warmup,
                    config,
                    backend,
                    shares // initiators,
                    shares,
                ),
                daemon=True,
            )
            proc.start()
            procs.append((conn, proc))
        for rank, (conn, p) in enumerate(procs):
            t_conn.send(_recv(conn, p, f"initiator {rank}"))
        _recv(t_conn, target, "target")  # every initiator registered
        for conn, _ in procs:
            conn.send("known")
        for rank, (conn, p) in enumerate(procs):
            _recv(conn, p, f"initiator {rank}")  # warmed up
        for conn, _ in procs:
            conn.send("go")
        spans = [_recv(conn, p, f"initiator {rank}", 600.0) for rank, (conn, p) in enumerate(procs)]
        t_conn.send("stop")
    finally:
        for _, p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        target.join(timeout=10)
        if target.is_alive():
            target.kill()
    start, end = min(s[0] for s in spans), max(s[1] for s in spans)
    return sum(s[2] for s in spans) / (end - start) / 1e9


def run_fan_in(
    initiators: int,
    points: list[tuple[int, int]],
    op: str,
    iters: int,
    warmup: int,
    host: str,
    config: TcpBackendConfig | RdmaBackendConfig,
    backend: str,
    target_host: str | None = None,
    target_netns: str | None = None,
) -> list[dict[str, Any]]:
    """One row per point: the aggregate GB/s of one initiator (``one_gbs``) and of ``initiators``
    at once (``fan_in_gbs``) through one target, and their ratio. The target runs in network
    namespace ``target_netns`` on ``target_host`` when given (the initiators in this one, on
    ``host``)."""
    rows = []
    where = (target_host or host, target_netns)
    for point in points:
        one = _aggregate(1, point, op, iters, warmup, host, config, backend, initiators, *where)
        many = _aggregate(initiators, point, op, iters, warmup, host, config, backend, initiators, *where)
        rows.append(
            {
                "size": point[0],
                "batch": point[1],
                "initiators": initiators,
                "iters": iters,
                "one_gbs": one,
                "fan_in_gbs": many,
                "ratio": many / one,
            }
        )
    return rows
