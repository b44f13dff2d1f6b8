"""The NVLink backend's transfers in flight and the inbound records it owes their targets.

A thread finishes transfers nobody polls (so targets get notified and resources come back) and
sends inbound records in batches (``BackendContext.send_completions``). It ticks every
millisecond while there is work and sleeps otherwise, and nothing on the transfer path wakes it
while it ticks: a background thread that wants the GIL while the caller submits or polls delays
the caller by a thread hand-off each time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...types import StatusCode
from ..base import BackendContext, TransferRequest
from ._queues import GpuTransfer

__all__ = ["Flight", "Housekeeping"]

_TICK_S = 1e-3  # housekeeping period while transfers run or records wait to be sent
_NOTIFY_EVERY_S = 2e-3  # inbound records are sent at most this often (batched in between)
_IDLE_S = 0.05  # with nothing to do for this long, housekeeping sleeps until the next transfer


@dataclass
class Flight:
    """A transfer in flight: its request and the remote region (engine key, memory id) it uses."""

    request: TransferRequest
    remote: tuple[str, int]


class Housekeeping:
    """Transfers in flight and records to send, under the backend's ``lock``, and the thread that
    tends them."""

    def __init__(self, ctx: BackendContext, lock: threading.RLock) -> None:
        self.ctx = ctx
        self._lock = lock
        self._cond = threading.Condition(lock)
        self._inflight: dict[GpuTransfer, Flight] = {}
        # Inbound records to send: (target engine key, uid, code, message); appended without
        # waking anyone (deque appends are atomic).
        self._notes: deque[tuple[str, int, int, str]] = deque()
        self._stop = threading.Event()
        self._asleep = False  # the thread waits on _cond until a transfer or record arrives
        self._thread = threading.Thread(target=self._run, name="mori-io-nvlink", daemon=True)
        self._thread.start()

    def add(self, transfer: GpuTransfer, flight: Flight) -> None:
        """Tends ``transfer`` until it ends (call with the lock held)."""
        self._inflight[transfer] = flight
        self._wake()

    def note(self, request: TransferRequest, code: StatusCode, message: str) -> None:
        """Owes ``request``'s target its inbound record (when the request asks for one)."""
        if request.notify:
            self._notes.append((request.remote.engine_key, request.uid, int(code), message))
            if self._asleep:
                with self._lock:
                    self._wake()

    def _wake(self) -> None:
        """Wakes the thread if it sleeps (call with the lock held); free while it ticks."""
        if self._asleep:
            self._asleep = False
            self._cond.notify()

    def on_done(self, transfer: GpuTransfer) -> None:
        """A transfer ended: its events and tables go back, its target is owed a record."""
        with self._lock:
            flight = self._inflight.pop(transfer, None)
        if not transfer.abandoned:  # a timed-out copy may still use them: leak rather than reuse
            transfer.queues.events.give(transfer.events)
            for table in transfer.tables:
                transfer.queues.kernel.tables.give(table)
        if flight is not None:
            self.note(flight.request, StatusCode(transfer.code()), transfer.message())

    def drain(self, match: Callable[[Flight], bool], what: str) -> None:
        """Finishes (bounded by MORI_IO_TIMEOUT) every in-flight transfer that matches."""
        deadline = time.monotonic() + self.ctx.io_timeout()
        while True:
            with self._lock:
                pending = [t for t, f in self._inflight.items() if match(f)]
            if not pending:
                return
            for transfer in pending:
                transfer.wait(0.0)  # ends it if its events fired (or its own deadline passed)
            if time.monotonic() > deadline:
                self.ctx.log.warning("nvlink: copies using %s still running after the timeout", what)
                return
            time.sleep(200e-6)

    def _run(self) -> None:
        quiet_since = last_sent = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                flights = list(self._inflight)
            for transfer in flights:
                transfer.wait(0.0)
            now = time.monotonic()
            if self._notes and now - last_sent >= _NOTIFY_EVERY_S:
                self._send_notes()
                last_sent = now
            if flights or self._notes:
                quiet_since = now
            elif now - quiet_since > _IDLE_S:
                with self._cond:
                    if not self._inflight and not self._notes:
                        self._asleep = True
                        # Re-checks the queues: a record appended (lock-free) while we decided
                        # to sleep waits at most one timeout.
                        while self._asleep and not self._stop.is_set() and not self._notes and not self._inflight:
                            self._cond.wait(0.5)
                        self._asleep = False
                quiet_since = time.monotonic()
                continue
            self._stop.wait(_TICK_S)
        self._send_notes()

    def _send_notes(self) -> None:
        """Sends every queued inbound record, one batch per target engine."""
        by_key: dict[str, list[tuple[int, int, str]]] = {}
        while self._notes:
            key, uid, code, message = self._notes.popleft()
            by_key.setdefault(key, []).append((uid, code, message))
        for key, records in by_key.items():
            self.ctx.send_completions(key, records)

    def stop(self) -> None:
        """Stops the thread after it sent what is owed (bounded by MORI_IO_TIMEOUT)."""
        self._stop.set()
        with self._lock:
            self._wake()
        self._thread.join(timeout=self.ctx.io_timeout())
