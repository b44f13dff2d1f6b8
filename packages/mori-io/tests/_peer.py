"""Helpers for the mori-io tests: shared buffers and an engine running in its own process.

``PeerProcess`` (a ``PipeProcess``) starts a real process (spawn) running an IOEngine with a TCP backend and serves
commands over a pipe; every wait on it has a timeout and the process is always reaped.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType
from mori.io.bench._mori_runner import start_in_netns

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


def _serve(conn: Any, key: str, token: str | None) -> None:
    engine = IOEngine(key, IOEngineConfig(host="127.0.0.1", port=0, auth_token=token))
    engine.create_backend(BackendType.TCP)
    buffers: dict[int, SharedBuffer] = {}
    descs: dict[int, MemoryDesc] = {}

    def register_shm(path: str, size: int) -> bytes:
        buf = SharedBuffer(size, path)
        desc = engine.register_memory(buf.addr, size, -1, MemoryLocationType.CPU)
        buffers[desc.id], descs[desc.id] = buf, desc
        return desc.pack()

    serve_commands(conn, engine, {**engine_commands(engine, descs), "register_shm": register_shm})


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


def serve_commands(conn: Any, engine: IOEngine, commands: dict[str, Callable[..., Any]]) -> None:
    """Announces the engine, then runs ``(cmd, args)`` requests from the pipe until ``stop``;
    each reply is ``("ok", value)`` or ``("err", repr)``."""
    conn.send(("ready", engine.get_engine_desc().pack()))
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            engine.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as err:  # reported to the test, which fails with it
            conn.send(("err", repr(err)))


class PipeProcess:
    """An engine process started with ``serve(child_conn, *args)`` and driven over a pipe (see
    :func:`serve_commands`); ``name`` labels its errors. Every wait has a timeout and the process
    is always reaped."""

    def __init__(self, serve: Callable[..., None], args: tuple[Any, ...], name: str, timeout: float,
                 netns: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, *args), daemon=True)
        start_in_netns(self.proc, netns)  # in network namespace ``netns`` when given
        child.close()
        self.name = name
        self.timeout = timeout
        try:
            _, packed = self._recv()
            self.desc = EngineDesc.unpack(packed)
        except BaseException:
            self.kill()
            raise

    def _recv(self) -> Any:
        if not self._conn.poll(self.timeout):
            raise TimeoutError(f"{self.name} process {self.proc.pid} did not answer in {self.timeout} s")
        return self._conn.recv()

    def call(self, cmd: str, *args: Any) -> Any:
        """Runs a command in the process; raises RuntimeError with its error."""
        self._conn.send((cmd, args))
        tag, value = self._recv()
        if tag != "ok":
            raise RuntimeError(f"{self.name} {cmd} failed: {value}")
        return value

    def signal(self, sig: int) -> None:
        """Sends a signal to the process."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """Kills and reaps the process."""
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(timeout=10)

    def close(self) -> None:
        """Stops the process cleanly, killing it if it does not stop in time."""
        try:
            if self.proc.is_alive():
                self.call("stop")
        except (TimeoutError, OSError, EOFError, RuntimeError):
            pass
        finally:
            self.proc.join(timeout=10)
            self.kill()


class PeerProcess(PipeProcess):
    """An IOEngine named ``key`` with a TCP backend in a separate process."""

    def __init__(self, key: str, token: str | None = None, timeout: float = 60.0) -> None:
        super().__init__(_serve, (key, token), "peer", timeout)
