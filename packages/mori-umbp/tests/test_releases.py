"""Read leases released off the reader's thread (``mori.umbp._releases``), against a node's real
peer service over gRPC: one call per owner for what waits, leases that ended are not sent, what
waits beyond the bound is dropped, and closing sends what waits."""

from __future__ import annotations

import time

import numpy as np
import pytest
from _master_harness import wait_until
from _pool import KiB, addr, small_config

from mori.umbp import _peer, _releases
from mori.umbp._store import LocalStore
from mori.umbp._transport import Peer, PeerChannel

PAGE = 16 * KiB


class _CountingService(_peer.PeerService):
    """The peer service, counting the release calls it answers."""

    releases = 0

    def BatchReleaseKeys(self, request, context):  # noqa: N802 (gRPC's name)
        type(self).releases += 1
        return super().BatchReleaseKeys(request, context)


@pytest.fixture()
def owner(tmp_path):
    """(store, peer) of a node's service on loopback, eight pages stored, and a channel to it."""
    store = LocalStore(small_config(tmp_path, dram=256 * KiB, ssd=False))
    src = np.arange(8 * PAGE, dtype=np.uint8).reshape(8, PAGE)
    for i in range(8):
        assert store.write(f"k{i}", addr(src, i), PAGE)
    _CountingService.releases = 0
    service = _CountingService(store, b"engine", b"buffer", 64 * KiB)
    server = _peer.serve(service, "127.0.0.1", 0)
    channel = PeerChannel(f"127.0.0.1:{server.port}", 5.0)
    yield store, Peer(channel.address, channel, None, None)  # type: ignore[arg-type]
    channel.close()
    server.stop(0)
    service.close()
    store.close()


def _leases(store: LocalStore) -> int:
    with store._lock:
        return sum(len(e.leases or ()) for e in store._index.values())


def test_what_waits_for_one_owner_goes_in_one_call(owner) -> None:
    store, peer = owner
    slots = store.resolve_many([f"k{i}" for i in range(8)], lease_s=30.0)
    releaser = _releases.LeaseReleaser()
    try:
        until = time.monotonic() + 30.0
        with releaser._cond:  # queued together: the thread takes them at once
            for slot in slots:
                assert slot is not None
                releaser.release(peer, [slot.key], [slot.lease_id], until)
        wait_until(lambda: _leases(store) == 0, 10, "the leases released")
        assert _CountingService.releases == 1
    finally:
        releaser.close()


def test_leases_that_ended_are_not_sent_and_closing_sends_what_waits(owner) -> None:
    store, peer = owner
    ended = store.resolve("k0", lease_s=30.0)
    waiting = store.resolve("k1", lease_s=30.0)
    assert ended is not None and waiting is not None
    releaser = _releases.LeaseReleaser()
    releaser.release(peer, ["k0"], [ended.lease_id], time.monotonic() - 1.0)  # the reader's time is over
    releaser.close()
    releaser = _releases.LeaseReleaser()
    releaser.release(peer, ["k1"], [waiting.lease_id], time.monotonic() + 30.0)
    releaser.close()  # sends what waits before the thread ends
    assert not releaser._thread.is_alive()
    assert not store.release("k1", waiting.lease_id)  # k1's was sent
    assert store.release("k0", ended.lease_id)  # k0's was not: the owner still held it


def test_what_waits_is_bounded(owner, monkeypatch) -> None:
    store, peer = owner
    monkeypatch.setattr(_releases, "MAX_WAITING", 3)
    slots = store.resolve_many([f"k{i}" for i in range(8)], lease_s=30.0)
    releaser = _releases.LeaseReleaser()
    try:
        until = time.monotonic() + 30.0
        with releaser._cond:
            for slot in slots:
                assert slot is not None
                releaser.release(peer, [slot.key], [slot.lease_id], until)  # the fourth on are dropped
        wait_until(lambda: _leases(store) == 5, 10, "three leases released")
    finally:
        releaser.close()
    assert _leases(store) == 5
