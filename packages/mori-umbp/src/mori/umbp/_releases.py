"""Read leases released off the reader's thread.

A reader whose mori-io read of a peer's slots ended within the lease the peer gave has that
value's bytes (the owner keeps a leased slot's memory until the lease ends or is released), so
it need not wait for the release's answer: :class:`LeaseReleaser` sends the releases from a
thread of its own, those for one peer gathered into one call. What is not sent in time is
harmless: a lease also ends by itself. The releases waiting are bounded; beyond the bound they
are dropped (their leases run out instead). A reader that asks a peer again for DRAM its own
leases hold first settles that peer's releases (:meth:`LeaseReleaser.settle`).
"""

from __future__ import annotations

import threading
import time

from mori.core.log import get_logger

from ._master._proto import umbp_peer_pb2 as pb
from ._transport import Peer, PeerUnavailableError

_log = get_logger("umbp")
#: Releases waiting at once; more are dropped.
MAX_WAITING = 65536
#: Keys in one release call (the peer service's bound on a request).
MAX_BATCH = 4096


class LeaseReleaser:
    """Sends ``BatchReleaseKeys`` for finished reads in the background (see the module's doc)."""

    def __init__(self) -> None:
        # peer address -> (peer, keys, lease ids, when the last of those leases ends)
        self._waiting: dict[str, tuple[Peer, list[str], list[int], float]] = {}
        #: Addresses whose releases the thread is sending now.
        self._sending: set[str] = set()
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="umbp-release", daemon=True)
        self._thread.start()

    def release(self, peer: Peer, keys: list[str], lease_ids: list[int], until: float) -> None:
        """Queues the release of ``keys``' leases on ``peer``, which run to ``until`` (monotonic
        seconds) at the latest."""
        with self._cond:
            if self._closed or self._count + len(keys) > MAX_WAITING:
                return
            _, waiting_keys, waiting_ids, last = self._waiting.get(peer.address, (peer, [], [], 0.0))
            waiting_keys.extend(keys)
            waiting_ids.extend(lease_ids)
            self._waiting[peer.address] = (peer, waiting_keys, waiting_ids, max(last, until))
            self._count += len(keys)
            self._cond.notify_all()  # the thread, and readers settling

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait(1.0)
                if not self._waiting:
                    return
                waiting, self._waiting, self._count = self._waiting, {}, 0
                self._sending = set(waiting)
            for address, (peer, keys, lease_ids, until) in waiting.items():
                if until > time.monotonic():  # else the leases have ended by themselves
                    self._send(peer, keys, lease_ids)
                with self._cond:
                    self._sending.discard(address)
                    self._cond.notify_all()

    def _send(self, peer: Peer, keys: list[str], lease_ids: list[int]) -> None:
        for start in range(0, len(keys), MAX_BATCH):
            request = pb.BatchReleaseKeysRequest(
                keys=keys[start : start + MAX_BATCH], lease_id=lease_ids[start : start + MAX_BATCH]
            )
            try:
                peer.call("BatchReleaseKeys", request)
            except PeerUnavailableError as exc:
                _log.debug("releasing %d leases on %s: %s", len(keys), peer.address, exc)
                return

    def pending(self, address: str) -> bool:
        """Whether releases for the peer at ``address`` are queued or being sent."""
        with self._cond:
            return self._pending_locked(address)

    def settle(self, address: str, timeout: float) -> bool:
        """Waits until the releases queued for the peer at ``address`` have been sent (answered
        or failed), at most ``timeout`` seconds: a reader asking that peer again for room its
        own leases hold. Whether they were."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending_locked(address), timeout)

    def _pending_locked(self, address: str) -> bool:
        return address in self._waiting or address in self._sending

    def close(self, timeout: float = 5.0) -> None:
        """Sends what waits, then stops the thread (waits at most ``timeout`` seconds)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # the thread, and readers settling
        self._thread.join(timeout)
