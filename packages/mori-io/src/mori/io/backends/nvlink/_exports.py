"""The target side of the NVLink backend: the GPU regions this engine exports, which engines
opened each (``nvlink.open``), and the revocation it sends them when a region or an engine goes."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from mori.core import cuda as _cuda

from ...types import EngineDesc, MemoryDesc, StatusCode
from ..base import BackendContext, ControlError
from ._peer_memory import ExportedRegion, FdServer, export_region

__all__ = ["Exports"]


class Exports:
    """Exported regions by memory id, under the backend's ``lock``."""

    def __init__(self, ctx: BackendContext, lock: threading.RLock) -> None:
        self.ctx = ctx
        self._lock = lock
        self._exports: dict[int, tuple[MemoryDesc, ExportedRegion]] = {}
        self._openers: dict[int, dict[str, EngineDesc]] = {}  # memory id -> engines that mapped it
        self._fd_server: FdServer | None = None

    def add(self, desc: MemoryDesc) -> MemoryDesc:
        """Exports GPU region ``desc``; returns it with its handle in ``extra["nvlink"]``."""
        exported = export_region(desc.data, desc.size, desc.device_id)
        # Work queued before registration (e.g. filling the tensor) is done before peers read it.
        _cuda.call("cuCtxSynchronize")
        with self._lock:
            self._exports[desc.id] = (desc, exported)
        return dataclasses.replace(desc, extra={"nvlink": exported.info})

    def remove(self, mem_id: int) -> tuple[ExportedRegion | None, dict[str, EngineDesc]]:
        """Stops serving region ``mem_id``: its export (closed by the caller once nothing uses it)
        and the engines that opened it."""
        with self._lock:
            entry = self._exports.pop(mem_id, None)
            openers = self._openers.pop(mem_id, {})
        return (None if entry is None else entry[1]), openers

    def opened_by(self, key: str) -> list[int]:
        """The regions engine ``key`` opened, forgotten as its openings."""
        with self._lock:
            ids = sorted(i for i, keys in self._openers.items() if key in keys)
            for i in ids:
                self._openers[i].pop(key)
        return ids

    def handle_open(self, key: str, body: dict[str, Any]) -> dict[str, Any]:
        """``nvlink.open``: what engine ``key`` needs to map a region it names (only a registered one)."""
        mem_id = body.get("id")
        if not isinstance(mem_id, int):
            raise ControlError(StatusCode.ERR_INVALID_ARGS, f"nvlink.open: memory id {mem_id!r} is not an int")
        try:
            opener = EngineDesc.unpack(body.get("engine", b""))
        except (TypeError, ValueError) as err:
            raise ControlError(StatusCode.ERR_INVALID_ARGS, f"nvlink.open: {err}") from None
        if opener.key != key:
            raise ControlError(
                StatusCode.ERR_INVALID_ARGS, f"nvlink.open: engine {key!r} sent the descriptor of {opener.key!r}"
            )
        with self._lock:
            entry = self._exports.get(mem_id)
            if entry is None:
                raise ControlError(
                    StatusCode.ERR_NOT_FOUND, f"memory {mem_id!r} is not registered with engine {self.ctx.engine_key!r}"
                )
            self._openers.setdefault(mem_id, {})[key] = opener
            desc, exported = entry
            reply: dict[str, Any] = {"info": exported.info, "size": desc.size, "data": desc.data}
            if exported.fd >= 0:
                if self._fd_server is None:
                    self._fd_server = FdServer(self.ctx.io_timeout())
                reply.update(fd_socket=self._fd_server.address, nonce=self._fd_server.grant(exported.fd))
        return reply

    def revoke(self, engine: EngineDesc, ids: list[int]) -> None:
        """Tells ``engine`` to drop its mappings of regions ``ids`` and waits until it has. A
        fresh connection: the engine may be unregistered here."""
        if not ids:
            return
        try:
            self.ctx.control_request_to(engine, "nvlink.revoke", {"ids": ids})
        except (ConnectionError, TimeoutError, OSError) as err:
            self.ctx.log.warning("nvlink: could not revoke memory %s from engine %r: %s", ids, engine.key, err)

    def close(self) -> None:
        """Closes every export and the fd server."""
        with self._lock:
            exports, self._exports = [e for _, e in self._exports.values()], {}
            fd_server, self._fd_server = self._fd_server, None
        for e in exports:
            e.close()
        if fd_server is not None:
            fd_server.close()
