"""mori's side of the benchmark: a target process and the initiator's timing loop."""

from __future__ import annotations

import ctypes
import functools
import mmap
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from typing import Any

from mori.core.testing import start_in_netns

from .. import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    RdmaBackendConfig,
    StatusCode,
    TcpBackendConfig,
)
from ._measure import block_layout, pin_target, summarize

__all__ = ["run_mori"]


def _create_backend(engine: IOEngine, backend: str, config: TcpBackendConfig | RdmaBackendConfig) -> None:
    engine.create_backend(BackendType.RDMA if backend == "rdma" else BackendType.TCP, config)


def _host_buffer(size: int) -> tuple[mmap.mmap, int]:
    """``size`` bytes of page-aligned host memory and their address (no numpy needed): private
    anonymous memory with huge pages advised from 4 MiB, as numpy allocates its arrays. The peers'
    buffers are numpy arrays, so both sides copy the same kind of memory (a shared mapping, mmap's
    default, never gets transparent huge pages, and the kernel copies it about half as fast)."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= 4 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _target(conn: Any, host: str, size: int, config: TcpBackendConfig | RdmaBackendConfig, backend: str) -> None:
    pin_target()
    engine = IOEngine("bench-target", IOEngineConfig(host=host, port=0))
    _create_backend(engine, backend, config)
    buf, addr = _host_buffer(size)
    mem = engine.register_memory(addr, size, -1, MemoryLocationType.CPU)
    conn.send((engine.get_engine_desc().pack(), mem.pack()))
    try:
        engine.register_remote_engine(EngineDesc.unpack(conn.recv()))
        conn.send("ready")
        conn.recv()  # stop
    finally:
        engine.close()


def run_mori(points: list[tuple[int, int]], op: str, session: bool, iters: int, warmup: int, host: str,
             config: TcpBackendConfig | RdmaBackendConfig, progress: Callable[[], None], backend: str = "tcp",
             target_host: str | None = None,
             target_netns: str | None = None) -> Iterator[dict[str, Any]]:
    """Yields one result row per (size, batch) point; target and initiator are separate processes,
    the target in network namespace ``target_netns`` on ``target_host`` when given."""
    need = max(s * b for s, b in points)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, target_host or host, need, config, backend), daemon=True)
    start_in_netns(target_netns)(proc)
    try:
        if not conn.poll(120):
            raise TimeoutError("benchmark target did not start in 120 s")
        t_engine, t_mem = conn.recv()
        engine = IOEngine("bench-initiator", IOEngineConfig(host=host, port=0))
        _create_backend(engine, backend, config)
        engine.register_remote_engine(EngineDesc.unpack(t_engine))
        conn.send(engine.get_engine_desc().pack())
        if not conn.poll(60):
            raise TimeoutError("benchmark target did not register the initiator in 60 s")
        conn.recv()
        rmem = MemoryDesc.unpack(t_mem)
        buf, addr = _host_buffer(need)
        lmem = engine.register_memory(addr, need, -1, MemoryLocationType.CPU)
        sess = engine.create_session(lmem, rmem)
        assert sess is not None
        for size, batch in points:
            l_offs, r_offs = block_layout(size, batch)
            sizes = [size] * batch
            if session:
                go: Callable[[int], Any] = functools.partial(
                    sess.batch_read if op == "read" else sess.batch_write, l_offs, r_offs, sizes)
            else:
                go = functools.partial(engine.batch_read if op == "read" else engine.batch_write,
                                       lmem, l_offs, rmem, r_offs, sizes)
            times, cpu = [], 0.0
            for i in range(warmup + iters):
                # The CPU clock first: reading it takes a system call (about 0.6 us), not part of the transfer.
                c0 = time.process_time()
                t0 = time.perf_counter()
                st = go(engine.allocate_transfer_uid())
                if st.WaitFor(60_000) != StatusCode.SUCCESS:
                    raise RuntimeError(f"benchmark transfer failed: {st}")
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                    cpu += time.process_time() - c0
            progress()
            yield summarize(size, batch, times, cpu)
        engine.close()
        conn.send("stop")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
