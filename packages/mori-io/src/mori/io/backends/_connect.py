"""Connecting to remote engines off the caller's thread, one thread per engine being connected.

Reaching a peer (a control request, then the backend's own connections) can take up to
``MORI_IO_TIMEOUT``. Transfers submitted meanwhile wait in that peer's queue with their status
``IN_PROGRESS``; a peer that does not answer delays only its own transfers, never another
peer's (a shared pool of connecting threads would let a few dead peers hold everyone up). Any
exception while connecting or starting a transfer finishes that transfer's status: none is left
waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ..types import StatusCode
from .base import ControlError, TransferRequest

__all__ = ["PeerConnector"]


class PeerConnector:
    """Runs ``connect(key) -> route`` once per waiting peer on its own thread, then
    ``start(route, request)`` for each transfer that waited; ``name`` prefixes the messages."""

    def __init__(self, name: str, connect: Callable[[str], Any], start: Callable[[Any, TransferRequest], None]) -> None:
        self._name = name
        self._connect = connect
        self._start = start
        self._waiting: dict[str, list[TransferRequest]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def submit(self, request: TransferRequest) -> None:
        """Queues ``request`` until its peer is reached (starting the connect if none runs)."""
        key = request.remote.engine_key
        request.status._set(StatusCode.IN_PROGRESS)
        with self._lock:
            if key in self._waiting:
                self._waiting[key].append(request)
                return
            self._waiting[key] = [request]
        try:
            threading.Thread(target=self._run, args=(key,), name=f"mori-io-{self._name}-connect", daemon=True).start()
        except RuntimeError as err:  # no thread to be had
            self._finish(key, None, StatusCode.ERR_BAD_STATE, f"{self._name} backend: cannot start connecting: {err}")

    def _run(self, key: str) -> None:
        route, code, message = None, StatusCode.ERR_BAD_STATE, ""
        if self.closed:
            message = f"{self._name} backend was closed before the transfer started"
        else:
            try:
                route = self._connect(key)
            except ControlError as err:
                code, message = err.code, f"{self._name} backend: {err}"
            except KeyError as err:
                code, message = StatusCode.ERR_NOT_FOUND, f"{self._name} backend: cannot reach engine {key!r}: {err}"
            except Exception as err:  # any failure ends the waiting transfers: none may hang
                message = f"{self._name} backend: cannot reach engine {key!r}: {err}"
        self._finish(key, route, code, message)

    def _finish(self, key: str, route: Any, code: StatusCode, message: str) -> None:
        with self._lock:
            requests = self._waiting.pop(key, [])
        for r in requests:
            if route is None:
                r.status._set(code, message)
                continue
            try:
                self._start(route, r)
            except Exception as err:  # off the caller's thread: an exception must end the transfer
                r.status._set(StatusCode.ERR_BAD_STATE, f"{self._name} backend: transfer {r.uid} could not start: {err}")
