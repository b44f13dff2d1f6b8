"""Helpers for the mori-io tests: shared buffers and an engine running in its own process.

``PeerProcess`` (a ``PipeProcess``) starts a real process (spawn, a mori.core.testing ``CommandProcess``)
running an IOEngine with a TCP backend and serves commands; every wait on it has a timeout and the process is
always reaped.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from mori.core import testing
from mori.core.testing import start_in_netns
from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType

__all__ = ["SharedBuffer", "PeerProcess", "PipeProcess", "engine_commands", "serve_commands"]


class SharedBuffer:
    """A file in /dev/shm mapped into every process that opens it (to check bytes across processes)."""

    def __init__(self, size: int, path: str | None = None) -> None:
        self.size = size
        self.path = path or f"/dev/shm/mori-io-test-{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if path is None:
                os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.addr = int(self.array.ctypes.data)

    def unlink(self) -> None:
        """Removes the file (mappings stay valid)."""
        if os.path.exists(self.path):
            os.unlink(self.path)


def _serve(key: str, token: str | None) -> bytes:
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, auth_token=token))
    engine.create_backend(BackendType.TCP)
    buffers: dict[int, SharedBuffer] = {}
    descs: dict[int, MemoryDesc] = {}

    def register_shm(path: str, size: int) -> bytes:
        buf = SharedBuffer(size, path)
        desc = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
        buffers[desc.id], descs[desc.id] = buf, desc
        return desc.pack()

    return serve_commands(engine, {**engine_commands(engine, descs), "register_shm": register_shm})


def engine_commands(engine: IOEngine, descs: dict[int, MemoryDesc]) -> dict[str, Callable[..., Any]]:
    """The commands every test engine process serves: engine (de)registration, memory
    deregistration by id (``descs`` maps the ids the process registered) and inbound status."""

    def pop_inbound(remote_key: str, uid: int, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            st = engine.pop_inbound_transfer_status(remote_key, uid)
            if st is not None:
                return int(st.Code())
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)

    return {
        "register_engine": lambda packed: engine.register_remote_engine(EngineDesc.unpack(packed)),
        "deregister_engine": lambda packed: engine.deregister_remote_engine(EngineDesc.unpack(packed)),
        "deregister": lambda mem_id: engine.deregister_memory(descs.pop(mem_id)),
        "pop_inbound": pop_inbound,
    }


def serve_commands(engine: IOEngine, commands: dict[str, Callable[..., Any]], *keep: Any) -> bytes:
    """Serves ``engine``'s ``commands`` (and ``close``, which closes it) to :meth:`PipeProcess.call`
    through mori.core.testing's ``serve_commands`` (``keep`` as there); returns the packed engine
    descriptor (what a serve function returns)."""
    testing.serve_commands({**commands, "close": engine.close}, engine, *keep)
    return engine.get_engine_desc().pack()


class PipeProcess(testing.CommandProcess):
    """An engine process: a :class:`mori.core.testing.CommandProcess` that ran ``serve(*args)``
    (which ends with :func:`serve_commands`); ``desc`` is its engine's descriptor. ``name`` labels
    its errors, ``netns`` names the network namespace it runs in and ``env`` is added to its
    environment before anything runs in it. Every wait has a timeout and the process is always
    reaped; ``close()`` closes the engine first."""

    def __init__(
        self,
        serve: Callable[..., bytes],
        args: tuple[Any, ...],
        name: str,
        timeout: float,
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(serve, args, name, timeout, env, start=start_in_netns(netns))
        try:
            self.desc = EngineDesc.unpack(self.ready)
        except BaseException:
            self.kill()
            raise


class PeerProcess(PipeProcess):
    """An IOEngine named ``key`` with a TCP backend in a separate process."""

    def __init__(self, key: str, token: str | None = None, timeout: float = 60.0) -> None:
        super().__init__(_serve, (key, token), "peer", timeout)
