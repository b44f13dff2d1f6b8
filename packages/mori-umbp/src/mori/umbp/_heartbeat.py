"""A node's heartbeat to the master: its liveness and capacities, and the KvEvents of its store,
in bundles numbered from 1 that the master acknowledges. A master that does not know the node
(restarted without its index, or the node's TTL ran out) gets a re-registration and a full sync
(every key the store holds); one that saw a gap in the numbers gets a full sync."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from mori.core.log import get_logger

from ._env import runtime_int
from ._events import KvEvent
from ._master_client import EventBundle, MasterClient, MasterError, MasterUnavailableError, NodeStatus
from ._store import LocalStore

_log = get_logger("umbp")
#: Events waiting for the master; past this, they are dropped for a full sync.
MAX_OUTBOX = 60000


class Heartbeat:
    """Registers the node, then ships its events (see the module's docstring). With ``auto``
    a thread does so every interval the master recommends, and sooner after a commit."""

    def __init__(
        self, master: MasterClient, store: LocalStore, capacities: Callable[[], Mapping[Any, Any]], auto: bool
    ) -> None:
        self._master, self._store, self._capacities = master, store, capacities
        self._outbox: list[KvEvent] = []
        self._outbox_lock = threading.Lock()
        self._pending: list[EventBundle] = []
        self._next_seq = 1
        self._full_sync = False
        self._send_lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self.threshold = runtime_int("UMBP_AUTO_FLUSH_EVENT_THRESHOLD", 128, 0)
        store.subscribe(self._on_event)
        self.interval_s = max(0.05, master.register_client(capacities()) / 1000)
        self._thread: threading.Thread | None = None
        if auto:
            self._thread = threading.Thread(target=self._run, name="umbp-heartbeat", daemon=True)
            self._thread.start()

    def _on_event(self, event: KvEvent) -> None:  # called with the store's lock held
        with self._outbox_lock:
            if len(self._outbox) >= MAX_OUTBOX:
                self._outbox.clear()
                self._full_sync = True
            self._outbox.append(event)
            if self.threshold and len(self._outbox) >= self.threshold:
                self._wake.set()

    def wake(self) -> None:
        """Ships what is waiting now rather than at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            self.send()

    def send(self) -> bool:
        """One heartbeat now; whether the master took it (and every event before it)."""
        with self._send_lock:
            try:
                if self._full_sync:
                    return self._sync()
                with self._outbox_lock:
                    events, self._outbox = self._outbox, []
                if events:
                    self._pending.append(EventBundle(self._next_seq, events))
                    self._next_seq += 1
                if sum(len(b.events) for b in self._pending) > MAX_OUTBOX:  # a long outage: start over
                    return self._sync()
                reply = self._master.heartbeat(self._pending, tier_capacities=self._capacities())
                if reply.status == NodeStatus.UNKNOWN:
                    _log.warning("the master does not know node %s: registering again", self._master.node_id)
                    self._master.register_client(self._capacities())
                    return self._sync()
                if reply.request_full_sync:
                    return self._sync()
                self._pending = [b for b in self._pending if b.seq > reply.acked_seq]
                return not self._pending
            except MasterUnavailableError as exc:
                _log.warning("heartbeat to %s failed: %s", self._master.master_address, exc)
                return False
            except MasterError as exc:  # refused (a limit, a bad event): the next one is a full sync
                _log.error("the master refused a heartbeat (%s): a full sync follows", exc)
                self._full_sync = True
                return False

    def _sync(self) -> bool:
        """A full sync: the master's record of this node becomes what the store holds now."""
        self._full_sync = True

        def reset() -> None:
            with self._outbox_lock:
                self._outbox.clear()

        events = self._store.snapshot(reset)
        baseline = self._next_seq
        self._master.heartbeat(
            [EventBundle(baseline, events)], tier_capacities=self._capacities(), full_sync=True, seq_baseline=baseline
        )
        self._pending, self._next_seq, self._full_sync = [], baseline + 1, False
        return True

    def close(self) -> None:
        """Stops the thread (after a last heartbeat, best effort)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self.send()
