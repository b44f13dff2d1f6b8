"""Helpers for the mori-io tests: shared buffers and an engine running in its own process.

``PeerProcess`` starts a real process (spawn) running an IOEngine with a TCP backend and serves
commands over a pipe; every wait on it has a timeout and the process is always reaped.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import signal
import uuid
from typing import Any

import numpy as np

from mori.io import BackendType, EngineDesc, IOEngine, IOEngineConfig, MemoryDesc, MemoryLocationType

__all__ = ["SharedBuffer", "PeerProcess"]


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

    def pop_inbound(remote_key: str, uid: int, timeout: float) -> int | None:
        import time

        deadline = time.monotonic() + timeout
        while True:
            st = engine.pop_inbound_transfer_status(remote_key, uid)
            if st is not None:
                return int(st.Code())
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)

    commands = {
        "register_engine": lambda packed: engine.register_remote_engine(EngineDesc.unpack(packed)),
        "deregister_engine": lambda packed: engine.deregister_remote_engine(EngineDesc.unpack(packed)),
        "register_shm": register_shm,
        "deregister": lambda mem_id: engine.deregister_memory(descs.pop(mem_id)),
        "pop_inbound": pop_inbound,
    }
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


class PeerProcess:
    """An IOEngine named ``key`` in a separate process."""

    def __init__(self, key: str, token: str | None = None, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, key, token), daemon=True)
        self.proc.start()
        child.close()
        self.timeout = timeout
        try:
            tag, packed = self._recv()
            self.desc = EngineDesc.unpack(packed)
        except BaseException:
            self.kill()
            raise

    def _recv(self) -> Any:
        if not self._conn.poll(self.timeout):
            raise TimeoutError(f"peer process {self.proc.pid} did not answer in {self.timeout} s")
        return self._conn.recv()

    def call(self, cmd: str, *args: Any) -> Any:
        """Runs a command in the peer; raises RuntimeError with the peer's error."""
        self._conn.send((cmd, args))
        tag, value = self._recv()
        if tag != "ok":
            raise RuntimeError(f"peer {cmd} failed: {value}")
        return value

    def signal(self, sig: int) -> None:
        """Sends a signal to the peer process."""
        if self.proc.pid is not None and self.proc.is_alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """Kills and reaps the peer."""
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(timeout=10)

    def close(self) -> None:
        """Stops the peer cleanly, killing it if it does not stop in time."""
        try:
            if self.proc.is_alive():
                self.call("stop")
        except (TimeoutError, OSError, EOFError, RuntimeError):
            pass
        finally:
            self.proc.join(timeout=10)
            self.kill()
