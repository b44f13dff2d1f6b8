"""Watermark-driven eviction advice (MORI's EvictionManager).

Each round, a (node, tier) whose used fraction is at or above the high watermark gets an
``EvictKey`` call with its least recently accessed keys, enough bytes to bring it down to the
low watermark (at most ``evict_batch_size`` keys a round). The peer evicts and ships REMOVE
events; the master's index changes only when those arrive, so a lost call costs nothing but a
round. Keys under a read lease are skipped.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from mori.core.log import get_logger

from ._proto import umbp_peer_pb2 as peer_pb
from ._proto import umbp_peer_pb2_grpc as peer_grpc
from .metrics import MasterMetrics
from .router import Router
from .settings import MasterSettings
from .store import TIER_NAMES, MetadataStore

log = get_logger("umbp.master")


class EvictionAdvisor:
    def __init__(self, settings: MasterSettings, store: MetadataStore, router: Router, metrics: MasterMetrics) -> None:
        self.settings = settings
        self.store = store
        self.router = router
        self.metrics = metrics
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[str, grpc.Channel]] = {}  # node -> (peer address, channel)
        self._pool = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="umbp-evict")

    def plan(self, now_ms: int) -> dict[str, list[tuple[int, str]]]:
        """node -> [(tier, key)] to evict this round."""
        s = self.settings
        plan: dict[str, list[tuple[int, str]]] = {}
        for record in self.router.alive_clients(now_ms).values():
            for tier, cap in record.caps.items():
                if cap.total == 0:
                    continue
                used = cap.total - cap.available
                if used / cap.total < s.eviction_high_watermark:
                    continue
                to_free = used - int(cap.total * s.eviction_low_watermark)
                freed = 0
                for key, size in self.store.eviction_candidates(record.node_id, tier, s.evict_batch_size, now_ms):
                    if freed >= to_free:
                        break
                    plan.setdefault(record.node_id, []).append((tier, key))
                    freed += size
        return plan

    def run_once(self, now_ms: int) -> int:
        """One round; returns how many keys were advised. The calls go out side by side, so that
        a slow or dead peer costs the others nothing."""
        plan = self.plan(now_ms)
        peers = {r.node_id: r.peer_address for r in self.router.alive_clients(now_ms).values()}
        calls = []
        for node_id, victims in plan.items():
            address = peers.get(node_id, "")
            if not address:
                log.warning("[EvictionAdvisor] no peer address for %s; skipping %d keys", node_id, len(victims))
                continue
            calls.append(self._pool.submit(self._advise, node_id, address, victims))
        return sum(call.result() for call in calls)

    def _advise(self, node_id: str, address: str, victims: list[tuple[int, str]]) -> int:
        keys = list(dict.fromkeys(key for _, key in victims))
        stub = peer_grpc.UMBPPeerStub(self._channel(node_id, address))
        try:
            stub.EvictKey(peer_pb.EvictKeyRequest(keys=keys), timeout=self.settings.evictkey_deadline_ms / 1000)
        except grpc.RpcError as e:
            log.warning("[EvictionAdvisor] EvictKey to %s failed: %s (retried next round)", node_id, e.code())
            self.metrics.evict_failed.labels(node_id).inc()
            self.forget(node_id)
            return 0
        for tier, _ in victims:
            self.metrics.evict_advised.labels(node_id, TIER_NAMES[tier]).inc()
        return len(keys)

    def _channel(self, node_id: str, address: str) -> grpc.Channel:
        with self._lock:
            entry = self._channels.get(node_id)
            if entry is not None and entry[0] == address:
                return entry[1]
            if entry is not None:
                entry[1].close()
            channel = grpc.insecure_channel(address)
            self._channels[node_id] = (address, channel)
            return channel

    def forget(self, node_id: str) -> None:
        """Closes the channel to a node that left or failed."""
        with self._lock:
            entry = self._channels.pop(node_id, None)
        if entry is not None:
            entry[1].close()

    def close(self) -> None:
        """Drops queued calls and cancels those in flight (closing a channel cancels its calls),
        so that a stop does not wait out a slow peer's deadline."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            entries, self._channels = list(self._channels.values()), {}
        for _, channel in entries:
            channel.close()
        self._pool.shutdown(wait=True)
