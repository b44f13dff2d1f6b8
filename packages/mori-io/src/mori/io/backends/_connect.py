"""First contact with a remote engine, off the caller's thread, one thread per peer being reached:
every transport's way (TCP and RDMA per engine, NVLink per remote region it maps).

Reaching a peer (a control request, then the backend's own connections or mappings) can take up
to ``MORI_IO_TIMEOUT``. Transfers submitted meanwhile wait in that peer's queue, each with a
:class:`~mori.io.backends.Deferred` completion (``IN_PROGRESS``); a peer that does not answer
delays only its own transfers, never another peer's (a shared pool of connecting threads would
let a few dead peers hold everyone up). Once reached, each waiting completion follows the one its
transfer's start returns; any exception while connecting or starting a transfer ends that
transfer's completion: none is left waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

from ..types import StatusCode
from .base import Completion, ControlError, Deferred, TransferRequest

__all__ = ["PeerConnector"]


def _engine(request: TransferRequest) -> str:
    return request.remote.engine_key


class PeerConnector:
    """Runs ``connect(request) -> route`` once per waiting peer on its own thread (with the first
    request waiting for it), then ``start(route, request) -> completion`` for each transfer that
    waited;
    ``peer(request)`` names the peer a request waits for (by default its remote engine's key),
    ``name`` prefixes the messages."""

    def __init__(
        self,
        name: str,
        connect: Callable[[TransferRequest], Any],
        start: Callable[[Any, TransferRequest], Completion],
        peer: Callable[[TransferRequest], Hashable] = _engine,
    ) -> None:
        self._name = name
        self._connect = connect
        self._start = start
        self._peer = peer
        self._waiting: dict[Hashable, list[tuple[TransferRequest, Deferred]]] = {}
        self._lock = threading.Lock()
        self.closed = False

    def submit(self, request: TransferRequest) -> Deferred:
        """Queues ``request`` until its peer is reached (starting the connect if none runs); its
        completion."""
        key = self._peer(request)
        completion = Deferred()
        with self._lock:
            if key in self._waiting:
                self._waiting[key].append((request, completion))
                return completion
            self._waiting[key] = [(request, completion)]
        try:
            threading.Thread(
                target=self._run, args=(key, request), name=f"mori-io-{self._name}-connect", daemon=True
            ).start()
        except RuntimeError as err:  # no thread to be had
            self._finish(key, None, StatusCode.ERR_BAD_STATE, f"{self._name} backend: cannot start connecting: {err}")
        return completion

    def _run(self, key: Hashable, first: TransferRequest) -> None:
        route, code, message = None, StatusCode.ERR_BAD_STATE, ""
        engine = first.remote.engine_key
        if self.closed:
            message = f"{self._name} backend was closed before the transfer started"
        else:
            try:
                route = self._connect(first)
            except ControlError as err:
                code, message = err.code, f"{self._name} backend: {err}"
            except KeyError as err:
                code, message = StatusCode.ERR_NOT_FOUND, f"{self._name} backend: cannot reach engine {engine!r}: {err}"
            except Exception as err:  # any failure ends the waiting transfers: none may hang
                message = f"{self._name} backend: cannot reach engine {engine!r}: {err}"
        self._finish(key, route, code, message)

    def _finish(self, key: Hashable, route: Any, code: StatusCode, message: str) -> None:
        with self._lock:
            requests = self._waiting.pop(key, [])
        for r, completion in requests:
            if route is None:
                completion.finish(code, message)
                continue
            try:
                completion.follow(self._start(route, r))
            except Exception as err:  # off the caller's thread: an exception must end the transfer
                completion.finish(
                    StatusCode.ERR_BAD_STATE, f"{self._name} backend: transfer {r.uid} could not start: {err}"
                )
