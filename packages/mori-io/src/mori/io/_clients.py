"""An engine's control connections to the remote engines registered with it: one each, opened at
the first request, proving this engine's key there (``_keys``), reconnected once when stale."""

from __future__ import annotations

import threading
from typing import Any

from ._control import ControlClient, ControlError
from ._keys import Identity
from ._limits import io_timeout
from ._registry import RemoteEngines
from .types import EngineDesc, StatusCode

__all__ = ["ControlClients"]


class ControlClients:
    """Control connections of the engine ``identity.key`` (``token``; its own control plane at
    ``reach``, where a target may challenge it) to the engines in ``remotes``."""

    def __init__(self, identity: Identity, token: str, remotes: RemoteEngines, reach: tuple[str, int]) -> None:
        self._identity = identity
        self._token = token
        self._remotes = remotes
        self._reach = reach
        self._clients: dict[str, ControlClient] = {}
        self._lock = threading.Lock()

    def connect(self, desc: EngineDesc) -> ControlClient:
        """A new control connection to ``desc``'s engine, registered here or not."""
        return ControlClient(
            desc.host,
            desc.port,
            self._identity.key,
            self._token,
            io_timeout(),
            proof=self._identity.proof_for(desc.key),
            reach=self._reach,
        )

    def request(self, remote_key: str, op: str, payload: dict[str, Any]) -> dict[str, Any]:
        """One request to the registered engine ``remote_key`` over its kept connection;
        ``ControlError`` (``ERR_NOT_FOUND`` when it is not registered), ``TimeoutError``."""
        desc = self._remotes.get(remote_key)
        if desc is None:
            raise ControlError(StatusCode.ERR_NOT_FOUND, f"engine {remote_key!r} is not registered")
        for attempt in range(2):
            with self._lock:
                client = self._clients.get(remote_key)
            if client is None:
                client = self.connect(desc)
                with self._lock:
                    self._clients[remote_key] = client
            try:
                return client.request(op, payload)
            except ControlError as err:
                if err.code != StatusCode.ERR_BAD_STATE or attempt == 1:
                    raise
                with self._lock:  # a stale connection: reconnect once
                    self._clients.pop(remote_key, None)
                client.close()
        raise AssertionError("unreachable")

    def drop(self, remote_key: str) -> None:
        """Closes the connection to ``remote_key``, if any."""
        with self._lock:
            client = self._clients.pop(remote_key, None)
        if client is not None:
            client.close()

    def close(self) -> None:
        """Closes every connection."""
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            c.close()
