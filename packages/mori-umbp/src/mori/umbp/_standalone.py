"""The standalone-process mode: the pool in a server process on this host (MORI's
``umbp_standalone_server``), its clients' pages in shared memory it maps.

The server (``umbp_standalone_server unix:///PATH``, also ``mori-umbp-standalone``) builds its
store from the ``UMBP_*`` variables (:meth:`UMBPConfig.from_environment`) and serves
``umbp.UMBPStandalone`` over gRPC on the Unix socket ``PATH``, and a descriptor socket at
``PATH.fd``. A client opens one session on the descriptor socket for its lifetime and registers
each buffer there: its ``memfd`` passes over ``SCM_RIGHTS`` (a buffer from
:class:`UMBPHostMemAllocator` with an ``AnonymousShm*`` backing), and the server maps it. A data
call then names each page by the client's base address of its buffer and an offset, and the
server copies between that mapping and its store. When the session closes (the client exited or
died) the server unmaps the client's buffers. A client process can start the server itself
(``auto_start``), and then stops it when it closes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import mmap
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import msgpack

from mori.core.log import get_logger
from mori.core.memory import buffer_span, recv_fds, send_fds

from ._checks import check_keys
from ._config import UMBPConfig, UMBPStandaloneProcessConfig, validate
from ._enums import UMBPDeploymentMode
from ._hostmem import shared_buffer_of
from ._master._proto import umbp_standalone_pb2 as pb
from ._master._proto import umbp_standalone_pb2_grpc as pb_grpc
from ._signals import StopSignals
from ._store import LocalStore

_log = get_logger("umbp")
#: Buffers one client may register, and entries in one data call.
MAX_REGIONS, MAX_BATCH = 64, 65536
SESSION_TIMEOUT_S = 10.0


def socket_path(address: str) -> str:
    """The filesystem path of a ``unix://PATH`` address (the only kind: descriptors need one)."""
    if not address.startswith("unix://") or len(address) <= len("unix://"):
        raise ValueError(
            f"standalone_process.address must be unix:///PATH (descriptors pass over a Unix socket), got {address!r}"
        )
    return address[len("unix://") :]


class _Region:
    """A client's buffer as the server maps it."""

    def __init__(self, fd: int, size: int) -> None:
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self.address, self.size = buffer_span(self.map)[0], size
        self.users = 0
        self.dead = False


class StandaloneServer:
    """The server's side (see the module's docstring)."""

    def __init__(self, address: str, cfg: UMBPConfig) -> None:
        self.path = socket_path(address)
        validate(cfg)
        self.store = LocalStore(cfg)
        self._regions: dict[tuple[str, int], _Region] = {}
        self._lock = threading.Condition()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path + ".fd")
        self._fd_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_listener.bind(self.path + ".fd")
        self._fd_listener.listen(64)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="umbp-standalone-fd", daemon=True)]
        self._grpc = grpc.server(
            concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="umbp-standalone"),
            options=[("grpc.max_receive_message_length", 64 << 20)],
        )
        pb_grpc.add_UMBPStandaloneServicer_to_server(_Servicer(self), self._grpc)
        if self._grpc.add_insecure_port(address) == 0:
            raise OSError(f"the standalone server cannot listen on {address}")

    def start(self) -> None:
        self._grpc.start()
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._stop.set()
        self._grpc.stop(grace=1.0).wait(5)
        self._fd_listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path + ".fd")
        self.store.close()

    # -- sessions -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._fd_listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(conn,), name="umbp-standalone-session", daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        """One client's session: registrations until it closes, then its buffers are unmapped."""
        client_id = ""
        try:
            while not self._stop.is_set():
                if not select.select([conn], [], [], 1.0)[0]:
                    continue  # a session is idle between registrations for as long as it likes
                try:
                    payload, fds = recv_fds(conn, timeout=SESSION_TIMEOUT_S)
                except (OSError, ConnectionError, ValueError):  # closed, timed out or malformed: ended
                    return
                reply = self._register(payload, fds)
                client_id = client_id or reply.pop("client_id", "")
                send_fds(conn, [], msgpack.packb(reply), timeout=SESSION_TIMEOUT_S)
        finally:
            conn.close()
            if client_id:
                self._drop_client(client_id)

    def _register(self, payload: bytes, fds: list[int]) -> dict[str, Any]:
        try:
            request = msgpack.unpackb(payload)
            client_id, base, size = str(request["client_id"]), int(request["base"]), int(request["size"])
            if request.get("op") == "deregister":
                self._drop(client_id, base)
                return {"ok": True, "client_id": client_id}
            if len(fds) != 1 or size <= 0:
                return {"ok": False, "error": "a registration carries one descriptor and a positive size"}
            with self._lock:
                if sum(1 for c, _ in self._regions if c == client_id) >= MAX_REGIONS:
                    return {"ok": False, "error": f"a client registers at most {MAX_REGIONS} buffers"}
            region = _Region(fds[0], size)
            with self._lock:
                old = self._regions.get((client_id, base))
                self._regions[(client_id, base)] = region
            if old is not None:
                self._retire(old)
            return {"ok": True, "client_id": client_id}
        except (KeyError, TypeError, ValueError, OSError, msgpack.UnpackException) as exc:
            return {"ok": False, "error": f"bad registration: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)

    def _drop(self, client_id: str, base: int) -> None:
        with self._lock:
            region = self._regions.pop((client_id, base), None)
        if region is not None:
            self._retire(region)

    def _drop_client(self, client_id: str) -> None:
        with self._lock:
            mine = [k for k in self._regions if k[0] == client_id]
            regions = [self._regions.pop(k) for k in mine]
        for region in regions:
            self._retire(region)

    def _retire(self, region: _Region) -> None:
        """Unmaps a region once no data call uses it."""
        with self._lock:
            region.dead = True
            deadline = time.monotonic() + 30
            while region.users and time.monotonic() < deadline:
                self._lock.wait(0.5)
            if region.users:
                _log.warning("a client's buffer is still in use after 30 s: left mapped")
                return
        region.map.close()

    def addresses(
        self, client_id: str, bases: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[int | None], list[_Region]]:
        """Each page's address in this process (None when outside a registered buffer), and the
        regions held for the call (give them back with :meth:`done`)."""
        out: list[int | None] = []
        held: list[_Region] = []
        with self._lock:
            for base, offset, size in zip(bases, offsets, sizes):
                region = self._regions.get((client_id, base))
                if region is None or region.dead or size <= 0 or offset + size > region.size:
                    out.append(None)
                    continue
                region.users += 1
                held.append(region)
                out.append(region.address + offset)
        return out, held

    def done(self, held: list[_Region]) -> None:
        with self._lock:
            for region in held:
                region.users -= 1
            self._lock.notify_all()


class _Servicer(pb_grpc.UMBPStandaloneServicer):
    def __init__(self, server: StandaloneServer) -> None:
        self._server = server
        self._store = server.store

    def _keys(self, keys: Sequence[str], context: grpc.ServicerContext) -> list[str]:
        if len(keys) > MAX_BATCH:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys; the most is {MAX_BATCH}")
        try:
            return check_keys(keys)
        except (TypeError, ValueError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # not reached: abort raises

    def _pages(
        self, request: Any, context: grpc.ServicerContext
    ) -> tuple[list[str], list[int | None], list[int], list[_Region]]:
        keys = self._keys(request.keys, context)
        if not len(keys) == len(request.shm_offsets) == len(request.sizes) == len(request.region_bases):
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "keys, shm_offsets, sizes and region_bases differ in length"
            )
        addresses, held = self._server.addresses(
            request.client_id, request.region_bases, request.shm_offsets, request.sizes
        )
        return keys, addresses, list(request.sizes), held

    def Ping(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.PingResponse(ready=True, deployment_mode=pb.STANDALONE_BACKEND_LOCAL, supports_ranged_io=False)

    def BatchPutWithDepth(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys, addresses, sizes, held = self._pages(request, context)
        depths = list(request.depths) or [-1] * len(keys)
        try:
            ok = [
                a is not None and 0 < s <= self._store.buffer_size and self._store.write(k, a, s, d)
                for k, a, s, d in zip(keys, addresses, sizes, depths)
            ]
        finally:
            self._server.done(held)
        return pb.BatchBoolResponse(ok=ok)

    def BatchGet(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys, addresses, sizes, held = self._pages(request, context)
        try:
            index = [i for i, a in enumerate(addresses) if a is not None]
            got = (
                self._store.read(
                    [keys[i] for i in index],
                    [addresses[i] for i in index],  # type: ignore[misc]
                    [sizes[i] for i in index],
                )
                if index
                else []
            )
            ok = [False] * len(keys)
            for i, hit in zip(index, got):
                ok[i] = hit
        finally:
            self._server.done(held)
        return pb.BatchBoolResponse(ok=ok)

    def BatchExists(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.BatchBoolResponse(ok=[self._store.contains(k) for k in self._keys(request.keys, context)])

    def BatchExistsConsecutive(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys = self._keys(request.keys, context)
        count = next((i for i, k in enumerate(keys) if not self._store.contains(k)), len(keys))
        return pb.CountResponse(count=count)

    def Clear(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._store.clear()
        return pb.BoolResponse(ok=True)

    def Flush(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.BoolResponse(ok=self._store.flush())


class StandaloneConnection:
    """A client's side: the gRPC channel, the descriptor session, and the server it started."""

    _ids = itertools.count()

    def __init__(self, sp: UMBPStandaloneProcessConfig, rpc_timeout_s: float = 30.0) -> None:
        self.path = socket_path(sp.address)
        self.client_id = f"{os.getpid()}-{next(self._ids)}"
        self.timeout_s = rpc_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._channel = grpc.insecure_channel(sp.address)
        self._stub = pb_grpc.UMBPStandaloneStub(self._channel)
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        deadline = time.monotonic() + sp.startup_timeout_ms / 1000
        if not self._ping(0.5) and sp.auto_start:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "mori.umbp._standalone", sp.address], stdin=subprocess.DEVNULL
            )
        while not self._ping(0.5):
            if time.monotonic() > deadline or (self._process is not None and self._process.poll() is not None):
                self.close()
                raise RuntimeError(
                    f"no UMBP standalone server answers at {sp.address} within "
                    f"{sp.startup_timeout_ms} ms" + ("" if sp.auto_start else " (auto_start is off)")
                )
            time.sleep(0.1)
        self._session = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._session.connect(self.path + ".fd")

    def _ping(self, timeout: float) -> bool:
        try:
            return bool(self._stub.Ping(pb.Empty(), timeout=timeout).ready)
        except grpc.RpcError:
            return False

    def call(self, rpc: str, request: Any) -> Any:
        try:
            return getattr(self._stub, rpc)(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise RuntimeError(
                f"UMBP standalone server at {self.path}: {rpc} failed: {exc.code().name}: {exc.details()}"
            ) from None

    def register(self, ptr: int, size: int) -> bool:
        """Hands the server the shared buffer holding ``[ptr, ptr + size)``; False when it is not
        in one (no fallback: the server reads and writes the client's memory)."""
        handle = shared_buffer_of(ptr, size)
        if handle is None:
            _log.warning(
                "register_memory: [%#x, %#x) is not in a shared buffer (UMBPHostMemAllocator "
                "with an AnonymousShm backing); the standalone server cannot reach it",
                ptr,
                ptr + size,
            )
            return False
        reply = self._send(
            {"op": "register", "client_id": self.client_id, "base": handle.ptr, "size": handle.mapped_size}, [handle.fd]
        )
        if reply.get("ok"):
            with self._lock:
                self._regions[handle.ptr] = handle.mapped_size
        else:
            _log.warning("register_memory: the server refused: %s", reply.get("error"))
        return bool(reply.get("ok"))

    def deregister(self, ptr: int) -> None:
        """Withdraws the buffer holding ``ptr`` from the server."""
        with self._lock:
            bases = [b for b, n in self._regions.items() if b <= ptr < b + n]
            for base in bases:
                del self._regions[base]
        for base in bases:
            self._send({"op": "deregister", "client_id": self.client_id, "base": base, "size": 1}, [])

    def _send(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        with self._lock:
            send_fds(self._session, fds, msgpack.packb(message), timeout=SESSION_TIMEOUT_S)
            payload, extra = recv_fds(self._session, timeout=SESSION_TIMEOUT_S)
        for fd in extra:
            os.close(fd)
        return dict(msgpack.unpackb(payload))

    def place(self, ptr: int, size: int) -> tuple[int, int]:
        """``(region base, offset)`` of a page, or ``(0, 0)`` when no registered buffer holds it
        (the server then fails that page)."""
        with self._lock:
            for base, length in self._regions.items():
                if base <= ptr and ptr + size <= base + length:
                    return base, ptr - base
        return 0, 0

    # -- the pool's calls ----------------------------------------------------------------------

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int], depths: list[int]) -> list[bool]:
        places = [self.place(p, s) for p, s in zip(ptrs, sizes)]
        request = pb.BatchDataWithDepthRequest(
            keys=keys,
            client_id=self.client_id,
            sizes=sizes,
            depths=depths,
            shm_offsets=[o for _, o in places],
            region_bases=[b for b, _ in places],
        )
        return list(self.call("BatchPutWithDepth", request).ok)

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        places = [self.place(p, s) for p, s in zip(ptrs, sizes)]
        request = pb.BatchDataRequest(
            keys=keys,
            client_id=self.client_id,
            sizes=sizes,
            shm_offsets=[o for _, o in places],
            region_bases=[b for b, _ in places],
        )
        return list(self.call("BatchGet", request).ok)

    def exists(self, keys: list[str]) -> list[bool]:
        return list(self.call("BatchExists", pb.BatchKeysRequest(keys=keys)).ok)

    def clear(self) -> bool:
        return bool(self.call("Clear", pb.Empty()).ok)

    def flush(self) -> bool:
        return bool(self.call("Flush", pb.Empty()).ok)

    def backend_mode(self) -> UMBPDeploymentMode:
        return deployment_of(self.call("Ping", pb.Empty()).deployment_mode)

    def close(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self._session.close()
        self._channel.close()
        if self._process is not None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(30)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(30)


def deployment_of(mode: int) -> UMBPDeploymentMode:
    """The server's backend mode as the client reports it."""
    return UMBPDeploymentMode.Distributed if mode == pb.STANDALONE_BACKEND_DISTRIBUTED else UMBPDeploymentMode.Local


def main(argv: list[str] | None = None) -> int:
    """``umbp_standalone_server unix:///PATH``: the server, until SIGINT or SIGTERM."""
    parser = argparse.ArgumentParser(prog="umbp_standalone_server", description=__doc__.splitlines()[0])
    parser.add_argument("address", help="unix:///PATH of the gRPC socket (the descriptor socket is PATH.fd)")
    args = parser.parse_args(argv)
    cfg = UMBPConfig.from_environment()
    Path(socket_path(args.address)).parent.mkdir(parents=True, exist_ok=True)
    server = StandaloneServer(args.address, cfg)
    signals = StopSignals()  # before the line a launcher waits for: a SIGTERM after it is caught
    server.start()
    print(f"[Standalone] Listening on {args.address}", flush=True)
    signals.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
