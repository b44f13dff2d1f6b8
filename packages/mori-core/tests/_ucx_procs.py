"""Two real processes with a UCX engine each (mori.core.ucx), for the engine's tests.

Each process maps a shared file that the test maps too: ``GUARD`` bytes, the engine's region
(memory id 1, ``SIZE`` bytes), ``GUARD`` bytes. The test fills and checks the whole file, so a
byte written outside the region shows. Processes load the UCX named by ``lib`` (``MORI_UCX_LIB``)
and run on one host or inside a network namespace (UCX's tcp transport over a veth pair).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mori.core import testing, ucx
from mori.core.batch import Batch
from mori.core.codes import TransferCode
from mori.core.log import get_logger

SIZE = 8 << 20
GUARD = 1 << 16
DEBIAN_UCX = "/usr/lib/x86_64-linux-gnu"


def wheel_ucx() -> str:
    """The libucx wheel's library folder (ci/requirements-dev.txt installs the wheel)."""
    spec = importlib.util.find_spec("libucx")
    assert spec is not None and spec.submodule_search_locations, "the libucx wheel is not installed"
    return str(Path(next(iter(spec.submodule_search_locations))) / "lib")


LIBS = {"debian": DEBIAN_UCX, "wheel": None}  # None: the wheel's folder, found when used


def lib_path(lib: str) -> str:
    path = LIBS[lib]
    return wheel_ucx() if path is None else path


def map_file(path: str, size: int) -> tuple[mmap.mmap, np.ndarray]:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


def _code_name(code: int) -> str:
    """A transfer's code by name; HUNG while it is still in progress."""
    return TransferCode(code).name if code != TransferCode.IN_PROGRESS else "HUNG"


def _serve(role: str, path: str, settings: list[tuple[str, str]], options: dict[str, Any]) -> dict[str, Any]:
    """The engine process: region 1 is the middle of the shared file at ``path``. ``run_as`` in
    options: the user id the process switches to once the file is mapped; ``eager_bytes``: the
    engine's (set once it is made)."""
    mm, arr = map_file(path, SIZE + 2 * GUARD)
    base = int(arr.ctypes.data)
    run_as = options.pop("run_as", None)
    if run_as is not None:
        os.setgid(run_as)
        os.setuid(run_as)
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    get_logger("core").addHandler(Keep(logging.WARNING))
    eager_bytes = options.pop("eager_bytes", 0)
    eng = ucx.make_engine(role, dict(settings), **options)
    eng.eager_bytes = eager_bytes
    eng.register_memory(1, base + GUARD, SIZE)
    peers: dict[str, ucx.UcxPeer] = {}
    started: dict[int, tuple[ucx.UcxTransfer, float]] = {}

    def connect(key: str, addresses: list[bytes], ticket: int, same_host: bytes = b"") -> tuple[bool, str]:
        peers[key] = eng.connect(key, addresses, ticket, same_host)
        return peers[key].same_host, peers[key].same_host_refusal

    def start(
        key: str, op: int, lofs: Any, rofs: Any, sizes: Any, uid: int = 0, notify: bool = False, remote_id: int = 1
    ) -> int:
        t = peers[key].submit(op, 1, Batch(lofs, rofs, sizes, src_base=base + GUARD), remote_id, uid, notify)
        started[id(t)] = (t, time.monotonic())
        return id(t)

    def finish(tid: int, wait: float = 60.0) -> tuple[str, str, float]:
        t, t0 = started.pop(tid)
        t.wait(wait)
        return _code_name(t.code()), t.message(), time.monotonic() - t0

    def poll(tid: int, wait: float = 10.0) -> tuple[str, float]:
        """Reads the transfer's code (never waits on it) until it ends or ``wait`` seconds pass."""
        t, t0 = started.pop(tid)
        while t.code() == TransferCode.IN_PROGRESS and time.monotonic() - t0 < wait:
            time.sleep(0.0001)
        return _code_name(t.code()), time.monotonic() - t0

    def transfer(
        key: str,
        op: int,
        lofs: Any,
        rofs: Any,
        sizes: Any,
        uid: int = 0,
        notify: bool = False,
        remote_id: int = 1,
        wait: float = 60.0,
    ) -> tuple[str, str, float]:
        return finish(start(key, op, lofs, rofs, sizes, uid, notify, remote_id), wait)

    def run_one(
        key: str, op: int, lo: int, ro: int, size: int, remote_id: int = 1, wait: float = 60.0
    ) -> tuple[int, str]:
        return tuple(peers[key].run_one(op, 1, base + GUARD + lo, ro, size, remote_id, False, wait))  # type: ignore[return-value]

    def pop(key: str, uid: int, wait: float = 10.0) -> int | None:
        deadline = time.monotonic() + wait
        code = eng.pop_inbound(key, uid)
        while code is None and time.monotonic() < deadline:
            time.sleep(0.001)
            code = eng.pop_inbound(key, uid)
        return code

    def register(mem_id: int, offset: int, size: int) -> bytes:
        return bytes(eng.register_memory(mem_id, base + offset, size))

    testing.serve_commands(
        {
            "admit": eng.admit,
            "connect": connect,
            "start": start,
            "finish": finish,
            "poll": poll,
            "transfer": transfer,
            "run_one": run_one,
            "pop": pop,
            "register": register,
            "deregister": eng.deregister_memory,
            "stats": eng.stats,
            "describe": lambda key: peers[key].describe(),
            "healthy": lambda key: peers[key].healthy(),
            "close": eng.close,
            "warnings": lambda: list(warnings),
            "settings": lambda: dict(eng.settings),
        },
        mm,
        eng,
    )
    return {"addresses": list(eng.addresses), "library": dict(ucx.ucx_library()), "same_host": eng.same_host_address}


class EngineProcess(testing.CommandProcess):
    """A process with a UCX engine (see the module docstring); ``arr`` is its shared file."""

    def __init__(
        self,
        role: str,
        lib: str,
        netns: str | None = None,
        settings: dict[str, str] | None = None,
        call_timeout: float = 90.0,
        **options: Any,
    ) -> None:
        self.path = f"/dev/shm/mori-ucx-test-{os.getpid()}-{role}-{time.monotonic_ns()}"
        with open(self.path, "wb") as f:
            f.truncate(SIZE + 2 * GUARD)
        self.mm, self.arr = map_file(self.path, SIZE + 2 * GUARD)
        env = {"MORI_UCX_LIB": lib_path(lib), "UCX_LOG_LEVEL": os.environ.get("UCX_LOG_LEVEL", "error")}
        try:
            super().__init__(
                _serve,
                (role, self.path, list((settings or {}).items()), options),
                role,
                call_timeout,
                env,
                start=testing.start_in_netns(netns),
            )
        except BaseException:
            os.unlink(self.path)
            raise
        self.addresses: list[bytes] = self.ready["addresses"]
        self.library: dict[str, Any] = self.ready["library"]
        self.same_host: bytes = self.ready["same_host"]

    @property
    def region(self) -> np.ndarray:
        """The registered part of the shared file."""
        return self.arr[GUARD : GUARD + SIZE]

    def remove(self) -> None:
        """Closes the engine (killing the process if it hangs) and removes the shared file."""
        try:
            self.close()
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


@dataclass
class Pair:
    """An initiator connected to a target."""

    init: EngineProcess
    target: EngineProcess
    lib: str
    where: str
    namespaces: tuple[testing.Namespace, ...]
    settings: dict[str, str]

    def transfer(
        self,
        op: int,
        lofs: Any,
        rofs: Any,
        sizes: Any,
        uid: int = 0,
        notify: bool = False,
        remote_id: int = 1,
        wait: float = 60.0,
    ) -> tuple[str, str, float]:
        """(code name, message, seconds) of one transfer from the initiator."""
        return self.init.call(
            "transfer",
            "target",
            op,
            list(map(int, lofs)),
            list(map(int, rofs)),
            list(map(int, sizes)),
            uid,
            notify,
            remote_id,
            wait,
            timeout=wait + 30,
        )


def settings_for(where: str, namespaces: tuple[testing.Namespace, ...] = ()) -> dict[str, str]:
    """UCX settings: between namespaces, tcp over the veth pair only (both namespaces share a
    machine, so UCX would otherwise find shared memory); on one host ("host": UCX's path, the
    initiator not offered the same-host path; "same-host": the engine's same-host path),
    UCX's defaults."""
    if where == "netns":
        return {"TLS": "tcp", "NET_DEVICES": ",".join(ns.device for ns in namespaces)}
    return {}


@contextlib.contextmanager
def engine_pair(
    lib: str,
    where: str,
    settings: dict[str, str] | None = None,
    init_lib: str | None = None,
    init_options: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[Pair]:
    """Target and initiator processes (UCX ``lib``, ``where`` = "host", "same-host" or "netns",
    UCX ``settings`` added to those of ``where``), connected: with "same-host" the initiator
    takes the target's same-host path (asserted). The initiator may run another UCX
    (``init_lib``) and take other engine options (``init_options``, over ``options``)."""
    with contextlib.ExitStack() as stack:
        namespaces: tuple[testing.Namespace, ...] = ()
        if where == "netns":
            namespaces = stack.enter_context(testing.network_namespaces())
        settings = {**settings_for(where, namespaces), **(settings or {})}
        ns_target = namespaces[1].name if namespaces else None
        ns_init = namespaces[0].name if namespaces else None
        target = EngineProcess("target", lib, ns_target, settings, **options)
        stack.callback(target.remove)
        init = EngineProcess("initiator", init_lib or lib, ns_init, settings, **{**options, **(init_options or {})})
        stack.callback(init.remove)
        ticket = target.call("admit", "initiator")
        offer = target.same_host if where == "same-host" else b""
        same_host, refusal = init.call("connect", "target", target.addresses, ticket, offer)
        assert same_host == (where == "same-host"), refusal
        yield Pair(init, target, init_lib or lib, where, namespaces, settings)


def fill(arr: np.ndarray, seed: int) -> None:
    arr[:] = np.random.default_rng(seed).integers(0, 256, arr.size, dtype=np.uint8)
