"""The initiator side of the NVLink backend: remote regions mapped into this process, asked of
their owner once (``nvlink.open``) per (engine, memory id), allocations shared by several regions
mapped once and reference counted, and revocations that void an opening begun before them."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from mori.core import cuda as _cuda

from ...types import MemoryDesc, StatusCode
from ..base import BackendContext, ControlError
from ._peer_memory import Mapping, fetch_fd, open_mapping

__all__ = ["Opened", "RemoteRegions"]


@dataclass
class Opened:
    """A remote region usable here: its address in this process and its registered size."""

    mapping_key: tuple[Any, ...]
    address: int
    size: int


class RemoteRegions:
    """Remote regions opened by this engine, under the backend's ``lock``; ``host`` is this
    host's key (a region of another host is refused)."""

    def __init__(self, ctx: BackendContext, host: str, lock: threading.RLock) -> None:
        self.ctx = ctx
        self._host = host
        self._lock = lock
        self._open_lock = threading.Lock()
        self._mappings: dict[tuple[Any, ...], list[Any]] = {}  # key -> [Mapping, users]
        self._opened: dict[tuple[str, int], Opened] = {}
        # Revocation generations: an open that began before a revocation of its region is void.
        self._revocations = 0
        self._revoked: dict[tuple[str, int], int] = {}

    def get(self, key: tuple[str, int]) -> Opened | None:
        """The opened region (engine key, memory id), if it is."""
        return self._opened.get(key)

    def of_engine(self, engine_key: str) -> list[tuple[str, int]]:
        """The regions of engine ``engine_key`` opened here."""
        with self._lock:
            return [k for k in self._opened if k[0] == engine_key]

    def open(self, remote: MemoryDesc, device: int) -> Opened:
        """Region ``remote`` mapped for local GPU ``device``: asks its owner at first use."""
        key = (remote.engine_key, remote.id)
        opened = self._opened.get(key)
        if opened is not None:
            return opened
        with self._open_lock:
            opened = self._opened.get(key)
            if opened is not None:
                return opened
            generation = self._revocations
            reply = self.ctx.control_request(
                remote.engine_key, "nvlink.open", {"id": remote.id, "engine": self.ctx.engine_desc().pack()}
            )
            info, data, size = reply["info"], int(reply["data"]), int(reply["size"])
            if info.get("host") != self._host:
                raise ControlError(StatusCode.ERR_BAD_STATE, f"engine {remote.engine_key!r} is on another host")
            owner_base = data - int(info["offset"])
            mkey = (remote.engine_key, info["pid"], owner_base, device if info["kind"] == "vmm" else -1)
            with self._lock:
                entry = self._mappings.get(mkey)
            if entry is None:
                fd = -1
                if "nonce" in reply and info["pid"] != os.getpid():
                    fd = fetch_fd(reply["fd_socket"], reply["nonce"], self.ctx.io_timeout())
                try:
                    mapping = open_mapping(info, data, device, fd)
                finally:
                    if fd >= 0:
                        os.close(fd)
                entry = [mapping, 0]
            opened = Opened(mkey, entry[0].base + int(info["offset"]), size)
            with self._lock:
                self._mappings[mkey] = entry
                entry[1] += 1
                if self._revoked.get(key, -1) > generation:  # revoked while we were opening it
                    self.release(mkey)
                    raise ControlError(
                        StatusCode.ERR_NOT_FOUND, f"memory {remote.id} of engine {remote.engine_key!r} was deregistered"
                    )
                self._opened[key] = opened
        return opened

    def release(self, mkey: tuple[Any, ...]) -> None:
        """One user less of mapping ``mkey``: unmapped with the last."""
        with self._lock:
            entry = self._mappings.get(mkey)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._mappings[mkey]
        mapping: Mapping = entry[0]
        try:
            mapping.close()
        except _cuda.CudaError as err:
            self.ctx.log.warning("nvlink: closing a peer mapping failed: %s", err)

    def drop(self, keys: list[tuple[str, int]], revoked: bool) -> list[Opened]:
        """Forgets regions ``keys`` (so no new copy uses them; ``revoked``: an opening under way
        is void too); the caller releases the returned ones once the copies using them end."""
        with self._lock:
            if revoked:
                self._revocations += 1
                self._revoked.update(dict.fromkeys(keys, self._revocations))
            return [self._opened.pop(k) for k in keys if k in self._opened]

    def close(self) -> None:
        """Releases every opened region."""
        with self._lock:
            opened, self._opened = list(self._opened.values()), {}
        for o in opened:
            self.release(o.mapping_key)
