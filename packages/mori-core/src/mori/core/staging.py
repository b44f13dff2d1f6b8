"""GPU memory staged through pinned host memory: mori-core's one native staging (C++
``csrc/gpu/``), used by every data plane that cannot reach CUDA memory itself: the native TCP data
plane (:mod:`mori.core.tcp`, both ends) and the UCX engine over transports without GPUDirect
(:mod:`mori.core.ucx`: :func:`mori.core.ucx.stage_gpu`, :func:`mori.core.ucx_atomic.serve_gpu`).

A :class:`Stager` owns CUDA streams (its lanes: each thread's copies take one, in order) and a
pool of pinned host memory of one context. A data
plane hands it to the native code (``tcp.Target.register_region(..., staging=s)``,
``tcp.Peer.submit(..., staging=s)``, ``ucx.stage_gpu(engine, s)``); from then on every block of
that GPU memory is copied by the copy engine between the GPU and memory lent by the pool, piece
by piece (1 MiB), the copy of one piece running while the wire moves another, with no Python per
transfer. Several ranges of device memory may go as one copy (:meth:`Stager.gather_to_host`,
:meth:`Stager.scatter_to_device`: KV pages scattered in the GPU, back to back in pinned memory),
queued in one ``cuMemcpyBatchAsync`` where the driver has it. :meth:`Stager.to_device_then_store`
copies bytes in and then stores a 64-bit word behind them on the same stream (a signal after its
data: whoever sees the word sees the bytes). The pool lends memory in powers of two from 64 KiB, keeps up to ``cache_bytes`` of it
for the next transfer and frees the rest; memory whose copy may still be running is never lent
again. Every wait is bounded by the Stager's timeout; after one ran out, the Stager refuses more
work (its stream may still be busy).

:func:`device_stager` gives the process's Stager for a device: pinned memory and copies in the
device's primary context (the CUDA runtime's, so memory that PyTorch allocates is reachable),
on a blocking stream, so a copy starts after work queued earlier on the legacy default stream
(PyTorch's default). It needs the ``mori-core[cuda]`` extra. :func:`mori.core.testing.standin_stager`
gives one over a host stand-in for the driver, for tests on machines with no GPU.

:meth:`Stager.stats` counts the pool's lending and the copies (each way, their bytes, the time from
queueing to the end seen, the time callers waited); ``MORI_STAGING_PROFILE=path`` makes each process
append every device Stager's statistics to that file at exit, one JSON line each: a profile of
where a staged transfer's time goes.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading

from . import config
from ._native.gpu import (
    STAGING_CACHE_BYTES,
    STAGING_ENTRY_POINTS,
    STAGING_OPTIONAL_ENTRY_POINTS,
    Staged,
    Stager,
)

__all__ = [
    "LANES",
    "STAGING_CACHE_BYTES",
    "STAGING_ENTRY_POINTS",
    "STAGING_OPTIONAL_ENTRY_POINTS",
    "Staged",
    "Stager",
    "device_stager",
]

#: Streams of a device's Stager: the threads of a data plane (a TCP connection's, say) take them
#: in turn, so that their copies neither wait behind each other's nor share a lock.
LANES = 16

_stagers: dict[tuple[int, float, str, int], Stager] = {}
_lock = threading.Lock()


def device_stager(
    device: int, *, timeout: float = 30.0, timeout_setting: str = "timeout", cache_bytes: int = STAGING_CACHE_BYTES
) -> Stager:
    """The process's :class:`Stager` for CUDA device ``device`` with these settings (made at first
    use, kept until exit and shared by every data plane that asks for the same settings): copies
    and pinned memory in the device's primary context, on :data:`LANES` blocking streams of its own.

    ``timeout`` bounds every wait for a copy (messages name ``timeout_setting``); ``cache_bytes``
    of pinned memory are kept between transfers. Raises :class:`mori.core.cuda.CudaUnavailableError`
    without cuda-bindings or a driver, :class:`mori.core.cuda.CudaError` when the device refuses.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
    key = (device, float(timeout), timeout_setting, cache_bytes)
    with _lock:
        stager = _stagers.get(key)
        if stager is None:
            if not _stagers and config.get("MORI_STAGING_PROFILE"):
                atexit.register(_write_profile)
            stager = _stagers[key] = _make(device, timeout, timeout_setting, cache_bytes)
        return stager


def _write_profile() -> None:
    """Appends each Stager's statistics to ``MORI_STAGING_PROFILE`` (one JSON line each), at exit."""
    path = config.get("MORI_STAGING_PROFILE")
    with _lock:
        lines = [
            json.dumps({"pid": os.getpid(), "argv": sys.argv, "device": key[0], **stager.stats()})
            for key, stager in _stagers.items()
        ]
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def _make(device: int, timeout: float, timeout_setting: str, cache_bytes: int) -> Stager:
    from . import cuda
    from .gpu import batch_entry_point, on_device

    with on_device(device) as context:
        drv = cuda.driver()
        streams = [
            int(cuda.call("cuStreamCreate", drv.CUstream_flags.CU_STREAM_DEFAULT, detail=f"device {device}"))
            for _ in range(LANES)
        ]
        entry_points = {name: cuda.entry_point(name) for name in STAGING_ENTRY_POINTS}
        batch = batch_entry_point()  # STAGING_OPTIONAL_ENTRY_POINTS: copies of several ranges in one call
        if batch:
            entry_points["cuMemcpyBatchAsync"] = batch
        return Stager(
            int(context),
            streams,
            entry_points,
            timeout,
            timeout_setting,
            cache_bytes,
            f"mori GPU staging (device {device})",
        )
