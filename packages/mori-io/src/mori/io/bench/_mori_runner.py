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

__all__ = ["gpu_of", "run_mori"]


def _create_backend(engine: IOEngine, backend: str, config: TcpBackendConfig | RdmaBackendConfig) -> None:
    engine.create_backend(BackendType.RDMA if backend.startswith("rdma") else BackendType.TCP, config)


def _host_buffer(size: int) -> tuple[mmap.mmap, int]:
    """``size`` bytes of page-aligned host memory and their address (no numpy needed): private
    anonymous memory with huge pages advised from 4 MiB, as numpy allocates its arrays. The peers'
    buffers are numpy arrays, so both sides copy the same kind of memory (a shared mapping, mmap's
    default, never gets transparent huge pages, and the kernel copies it about half as fast)."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= 4 << 20 and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def gpu_of(role: str) -> int:
    """The GPU of a side with ``--mem-type gpu``: the target's is GPU 0, the initiator's the last
    one (GPU 0 too on a one-GPU machine). The peers get the same pair (``MORI_PEER_GPUS``)."""
    try:
        import torch
    except ImportError:
        raise SystemExit("mori-io-bench --mem-type gpu needs torch (its tensors are the GPU buffers)") from None
    if not torch.cuda.is_available():
        raise SystemExit("mori-io-bench --mem-type gpu: torch sees no CUDA GPU here")
    return 0 if role == "target" else torch.cuda.device_count() - 1


def _buffer(size: int, mem_type: str, role: str) -> tuple[Any, int, int, MemoryLocationType]:
    """What keeps ``size`` bytes alive, their address, device and location: host memory, or with
    ``mem_type`` "gpu" a torch tensor on the side's GPU (made before the engine: importing torch
    loads the CUDA runtime that UCX's CUDA transports look for)."""
    if mem_type == "cpu":
        buf, addr = _host_buffer(size)
        return buf, addr, -1, MemoryLocationType.CPU
    import torch

    device = gpu_of(role)
    tensor = torch.ones(size, dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize(device)
    return tensor, int(tensor.data_ptr()), device, MemoryLocationType.GPU


def _target(
    conn: Any, host: str, size: int, config: TcpBackendConfig | RdmaBackendConfig, backend: str, mem_type: str
) -> None:
    pin_target()
    buf, addr, device, loc = _buffer(size, mem_type, "target")
    engine = IOEngine("bench-target", IOEngineConfig(host=host, port=0))
    _create_backend(engine, backend, config)
    mem = engine.register_memory(addr, size, device, loc)
    conn.send((engine.get_engine_desc().pack(), mem.pack()))
    try:
        engine.register_remote_engine(EngineDesc.unpack(conn.recv()))
        conn.send("ready")
        conn.recv()  # stop
    finally:
        engine.close()


def run_mori(
    points: list[tuple[int, int]],
    op: str,
    session: bool,
    iters: int,
    warmup: int,
    host: str,
    config: TcpBackendConfig | RdmaBackendConfig,
    progress: Callable[[], None],
    backend: str = "tcp",
    target_host: str | None = None,
    target_netns: str | None = None,
    mem_type: str = "cpu",
) -> Iterator[dict[str, Any]]:
    """Yields one result row per (size, batch) point; target and initiator are separate processes,
    the target in network namespace ``target_netns`` on ``target_host`` when given, moving host
    memory or, with ``mem_type`` "gpu", GPU memory (:func:`gpu_of`)."""
    need = max(s * b for s, b in points)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, target_host or host, need, config, backend, mem_type), daemon=True)
    start_in_netns(target_netns)(proc)
    try:
        deadline = time.monotonic() + 120
        while not conn.poll(0.2):
            if not proc.is_alive():
                raise RuntimeError(f"benchmark target exited (code {proc.exitcode}) before it started")
            if time.monotonic() > deadline:
                raise TimeoutError("benchmark target did not start in 120 s")
        t_engine, t_mem = conn.recv()
        buf, addr, device, loc = _buffer(need, mem_type, "initiator")
        engine = IOEngine("bench-initiator", IOEngineConfig(host=host, port=0))
        _create_backend(engine, backend, config)
        engine.register_remote_engine(EngineDesc.unpack(t_engine))
        conn.send(engine.get_engine_desc().pack())
        if not conn.poll(60):
            raise TimeoutError("benchmark target did not register the initiator in 60 s")
        conn.recv()
        rmem = MemoryDesc.unpack(t_mem)
        lmem = engine.register_memory(addr, need, device, loc)
        sess = engine.create_session(lmem, rmem)
        assert sess is not None
        for size, batch in points:
            l_offs, r_offs = block_layout(size, batch)
            sizes = [size] * batch
            if session:
                go: Callable[[int], Any] = functools.partial(
                    sess.batch_read if op == "read" else sess.batch_write, l_offs, r_offs, sizes
                )
            else:
                go = functools.partial(
                    engine.batch_read if op == "read" else engine.batch_write, lmem, l_offs, rmem, r_offs, sizes
                )
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
