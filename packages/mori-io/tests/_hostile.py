"""The target engine process of the hostile-load tests (test_hostile*.py): an engine with a TCP
backend and a 1 MiB region in its own process, with lowered limits set before it starts, and
the commands the tests drive it with."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import resource
import time

import numpy as np
from _peer import PipeProcess, engine_commands, serve_commands

from mori.io import BackendType, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType, StatusCode

__all__ = ["REGION", "Target", "good_write"]

REGION = 1 << 20


def _serve(key: str, env: dict[str, str]) -> bytes:
    os.environ.update(env)
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0))
    engine.create_backend(BackendType.TCP)
    arr = np.zeros(REGION, dtype=np.uint8)
    desc = engine.register_memory(int(arr.ctypes.data), REGION, -1, MemoryLocationType.CPU)

    def limit_fds(extra: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + extra, 4096))

    def probe() -> dict[str, int]:
        threads = fds = -1  # unknown while descriptors are used up
        try:
            with open("/proc/self/status") as f:
                threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            pass
        return {
            "threads": threads,
            "fds": fds,
            "conns": engine._server.connection_count(),
            "inbound": len(engine._inbound),
            **dataclasses.asdict(engine._server.stats),
        }

    extra: dict[int, MemoryDesc] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def add_region(size: int) -> bytes:
        """Registers ``size`` bytes mapped here (no Python object owns them: see drop_region)."""
        addr = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        ctypes.memset(addr, 0x5A, size)
        d = engine.register_memory(addr, size, -1, MemoryLocationType.CPU)
        extra[d.id] = d
        return d.pack()

    def drop_region(mem_id: int) -> float:
        """Deregisters a region of add_region, then unmaps it: a byte of it touched after
        deregister_memory returned kills this process. Returns how long deregistering took."""
        d = extra.pop(mem_id)
        t0 = time.monotonic()
        engine.deregister_memory(d)
        took = time.monotonic() - t0
        assert libc.munmap(d.data, d.size) == 0
        return took

    return serve_commands(
        engine,
        {
            **engine_commands(engine, {desc.id: desc}),
            "desc": desc.pack,
            "limit_fds": limit_fds,
            "probe": probe,
            "add_region": add_region,
            "drop_region": drop_region,
            "bytes": lambda off, n: bytes(arr[off : off + n]),
        },
    )


class Target(PipeProcess):
    """An engine with a TCP backend and one 1 MiB region, in its own process, under ``env``."""

    def __init__(self, env: dict[str, str] | None = None, key: str = "target") -> None:
        super().__init__(_serve, (key, env or {}), "target", 60.0)
        self.region = MemoryDesc.unpack(self.call("desc"))


def good_write(target: Target, fill: int, key: str = "good") -> None:
    """A fresh, well-behaved engine writes 4 KiB to the target."""
    src = np.full(4096, fill, dtype=np.uint8)
    with IOEngine(key, IOEngineConfig()) as eng:
        eng.create_backend(BackendType.TCP)
        eng.register_remote_engine(target.desc)
        ld = eng.register_memory(int(src.ctypes.data), src.size, -1, MemoryLocationType.CPU)
        st = eng.write(ld, 0, target.region, 0, 4096, 1)
        assert st.WaitFor(10_000) != StatusCode.IN_PROGRESS and st.Succeeded(), st
    assert target.call("bytes", 0, 4096) == bytes([fill]) * 4096
