"""The ``umbp.UMBPMaster`` gRPC service: checks every request, then asks the store and router.

A request that fails a check is refused whole with INVALID_ARGUMENT and a message naming the
field; one that would break a bound gets RESOURCE_EXHAUSTED; a store that cannot be reached
gives UNAVAILABLE. None of them changes anything.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sized
from typing import Any, TypeVar, cast

import grpc

from mori.core.log import get_logger

from .. import _grpc
from ._proto import umbp_pb2 as pb
from ._proto import umbp_pb2_grpc as pb_grpc
from .metrics import MasterMetrics
from .reported import ReportedMetrics, Sample
from .router import Router
from .settings import MasterSettings
from .store import (
    TIER_NAMES,
    TIERS,
    ClientRecord,
    HeartbeatStatus,
    KvEvent,
    MetadataStore,
    QuotaExceeded,
    StoreUnavailable,
    TierCapacity,
)

log = get_logger("umbp.master")

#: Longest address a client may register, and most tags, and the largest engine descriptor.
MAX_ADDRESS_BYTES = 256
MAX_TAGS = 64
MAX_ENGINE_DESC_BYTES = 64 << 10
#: The ``node`` label of metrics about requests naming a node the master does not know.
UNREGISTERED = "(unregistered)"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


F = TypeVar("F", bound=Callable[..., Any])


def _handler(fn: F) -> F:
    """Turns refusals and store failures into gRPC statuses, and times the call."""
    rpc = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: MasterService, request: Any, context: grpc.ServicerContext) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, request, context)
        except Rejected as e:
            code, message = e.code, str(e)
        except QuotaExceeded as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except StoreUnavailable as e:
            code, message = grpc.StatusCode.UNAVAILABLE, f"{rpc}: metadata store unavailable: {e}"
            log.error("[Master] %s", message)
        finally:
            self.metrics.rpc_latency.labels(rpc).observe(time.perf_counter() - start)
        self.metrics.rejected.labels(rpc, code.name).inc()
        context.abort(code, message)

    return wrapper  # type: ignore[return-value]


class MasterService(pb_grpc.UMBPMasterServicer):
    def __init__(self, settings: MasterSettings, store: MetadataStore, router: Router, metrics: MasterMetrics) -> None:
        self.settings = settings
        self.store = store
        self.router = router
        self.metrics = metrics

    # ---- checks -----------------------------------------------------------------------
    def _name(self, what: str, value: str, *, empty_ok: bool = False) -> None:
        if not value:
            if empty_ok:
                return
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what} must not be empty")
        n = len(value.encode())
        if n > self.settings.max_key_bytes:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what} is {n} bytes, longer than UMBP_MASTER_MAX_KEY_BYTES={self.settings.max_key_bytes}",
            )

    def _node_id(self, value: str, what: str = "node_id") -> None:
        self._name(what, value)
        # The Redis store keeps locations as fields "l|<node>|<tier>" and a node's keys in the set
        # "<prefix>:node:<node>:blocks": a node id holds no "|" and does not end in ":blocks".
        if "|" in value or any(ord(c) < 0x20 for c in value) or value.endswith(":blocks"):
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what} {value!r} holds '|' or a control character, or ends in ':blocks'",
            )

    def _batch(self, what: str, items: Sized, limit: int | None = None) -> None:
        n = len(items)
        limit = self.settings.max_batch if limit is None else limit
        if n > limit:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what} has {n} entries, more than the limit {limit}")

    def _keys(self, what: str, keys: Iterable[str]) -> list[str]:
        out = list(keys)
        self._batch(what, out)
        self._key_lengths(what, out)
        return out

    def _key_lengths(self, what: str, keys: list[str], is_ascii: bool = False) -> None:
        """Each key non-empty and at most ``max_key_bytes`` UTF-8 bytes. A batch whose longest key
        is short enough in characters (a character is at most 4 bytes, an ASCII one 1) passes
        in C loops; encoding each of 1,024 keys took 0.1 ms. ``is_ascii``: known to be ASCII."""
        limit = self.settings.max_key_bytes
        if all(keys):
            longest = max(map(len, keys), default=0)
            if longest * 4 <= limit or (longest <= limit and (is_ascii or all(map(str.isascii, keys)))):
                return
        for i, key in enumerate(keys):
            if not key or len(key.encode()) > limit:  # the check of _name, its message made only for a bad key
                self._name(f"{what}[{i}]", key)

    def _packed_keys(self, what: str, packed: bytes) -> list[str]:
        """Keys sent as UTF-8, each followed by a NUL byte, checked as :meth:`_keys` checks them."""
        if not packed:
            return []
        keys = _grpc.split_keys(packed, self.settings.max_batch, self.settings.max_key_bytes)
        if keys is not None:  # split and checked in C; else the checks below say what is wrong
            return keys
        count = packed.count(0)
        if count > self.settings.max_batch:  # before splitting: the bound holds for the work too
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what} has {count} entries, more than the limit {self.settings.max_batch}",
            )
        if packed[-1] != 0:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: the last key is not followed by a NUL byte")
        try:
            keys = packed.decode().split("\0")
        except UnicodeDecodeError as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: not UTF-8 at byte {e.start}") from None
        keys.pop()  # the empty string after the last NUL
        self._key_lengths(what, keys, packed.isascii())
        return keys

    def _size(self, what: str, size: int) -> None:
        if size <= 0 or size > self.settings.max_block_bytes:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{what}={size} is outside 1..UMBP_MASTER_MAX_BLOCK_BYTES={self.settings.max_block_bytes}",
            )

    @staticmethod
    def _tier(what: str, tier: int) -> int:
        if tier not in TIERS:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what}={tier} is not a tier (HBM=1, DRAM=2, SSD=3)")
        return tier

    def _caps(self, caps: Iterable[Any]) -> dict[int, TierCapacity]:
        out: dict[int, TierCapacity] = {}
        for c in caps:
            tier = self._tier("tier_capacities.tier", c.tier)
            if c.available_capacity_bytes > c.total_capacity_bytes:
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tier_capacities[{TIER_NAMES[tier]}]: available {c.available_capacity_bytes} "
                    f"exceeds total {c.total_capacity_bytes}",
                )
            out[tier] = TierCapacity(c.total_capacity_bytes, c.available_capacity_bytes, c.max_allocatable_bytes)
        return out

    # ---- lifecycle --------------------------------------------------------------------
    @_handler
    def RegisterClient(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._node_id(request.node_id)
        for what, value in (("node_address", request.node_address), ("peer_address", request.peer_address)):
            if len(value.encode()) > MAX_ADDRESS_BYTES:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is longer than {MAX_ADDRESS_BYTES} bytes")
        if len(request.engine_desc) > MAX_ENGINE_DESC_BYTES:
            raise Rejected(
                grpc.StatusCode.INVALID_ARGUMENT, f"engine_desc is longer than {MAX_ENGINE_DESC_BYTES} bytes"
            )
        self._batch("tags", request.tags, MAX_TAGS)
        for i, tag in enumerate(request.tags):
            self._name(f"tags[{i}]", tag)
        caps = self._caps(request.tier_capacities)
        record = ClientRecord(
            node_id=request.node_id,
            node_address=request.node_address,
            peer_address=request.peer_address,
            engine_desc=bytes(request.engine_desc),
            tags=list(request.tags),
            caps=caps,
        )
        stale_after = self.settings.expiry_s * 1000
        if not self.store.register_client(record, now_ms(), stale_after):
            raise Rejected(
                grpc.StatusCode.ALREADY_EXISTS, f"node {request.node_id!r} is already alive and cannot be re-registered"
            )
        log.info("[Master] registered %s (peer %s)", request.node_id, request.peer_address or "-")
        self.metrics.forget_node(request.node_id)
        self.metrics.set_capacities(request.node_id, caps)
        self._count_clients()
        return pb.RegisterClientResponse(
            heartbeat_interval_ms=self.settings.heartbeat_interval_ms,
            ack_seq=0,
            supports_max_allocatable_bytes=True,
            supports_logical_tiers=False,
        )

    @_handler
    def UnregisterClient(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._node_id(request.node_id)
        if self.store.unregister_client(request.node_id):
            log.info("[Master] unregistered %s", request.node_id)
        self.metrics.forget_node(request.node_id)
        self._count_clients()
        return pb.UnregisterClientResponse()

    def _count_clients(self) -> None:
        self.metrics.client_count.set(len(self.router.alive_clients(now_ms())))

    @_handler
    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._node_id(request.node_id)
        caps = self._caps(request.tier_capacities)
        bundles = list(request.bundles)
        per_bundle: list[list[KvEvent]] = []
        count = 0
        # A full sync lists every key the node holds, which its quota bounds (past the quota it is
        # refused as over it, below); a delta is one batch.
        limit = self.settings.max_batch
        if request.is_full_sync:
            limit = max(limit, self.settings.max_keys_per_client)
        for b, bundle in enumerate(bundles):
            per_bundle.append([])
            for i, e in enumerate(bundle.events):
                where = f"bundles[{b}].events[{i}]"
                self._name(f"{where}.key", e.key)
                tier = self._tier(f"{where}.tier", e.tier)
                if e.kind == pb.KvEvent.ADD:
                    self._size(f"{where}.size", e.size)
                elif e.kind != pb.KvEvent.REMOVE:
                    raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"{where}.kind={e.kind} is neither ADD nor REMOVE")
                per_bundle[-1].append(KvEvent(e.kind == pb.KvEvent.ADD, e.key, tier, e.size))
                count += 1
                if count > limit:
                    raise Rejected(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the heartbeat carries more than {limit} events (UMBP_MASTER_MAX_BATCH, for a full "
                        "sync UMBP_MASTER_MAX_KEYS_PER_CLIENT)",
                    )
        for i in range(1, len(bundles)):
            if not request.is_full_sync and bundles[i].seq != bundles[i - 1].seq + 1:
                raise Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"bundles[{i}].seq={bundles[i].seq} does not follow bundles[{i - 1}].seq={bundles[i - 1].seq}",
                )
        if request.is_full_sync:
            first = last = request.delta_seq_baseline
            start = 0
        else:
            # Bundles the master applied already (its reply was lost, and the node sends them
            # again) are skipped rather than taken for a gap.
            record = self.store.get_client(request.node_id) if bundles else None
            applied = record.seq if record is not None else 0
            start = next((i for i, b in enumerate(bundles) if b.seq > applied), len(bundles))
            if start < len(bundles):
                first, last = bundles[start].seq, bundles[-1].seq
            else:
                first = last = 0  # a keepalive: refreshes liveness, applies nothing
        events = [e for group in per_bundle[start:] for e in group]
        result = self.store.apply_heartbeat(
            request.node_id, first, last, now_ms(), caps, events, bool(request.is_full_sync)
        )
        response = pb.HeartbeatResponse(acked_seq=result.acked_seq, status=pb.CLIENT_STATUS_ALIVE)
        node = request.node_id
        if result.status == HeartbeatStatus.UNKNOWN:
            response.status = pb.CLIENT_STATUS_UNKNOWN
            return response
        if result.status == HeartbeatStatus.SEQ_GAP and first != 0 and not request.is_full_sync:
            response.request_full_sync = True
            self.metrics.seq_gap.labels(node).inc()
        elif result.status == HeartbeatStatus.APPLIED and events:
            self.metrics.events_applied.labels(node).inc(len(events))
        if result.status == HeartbeatStatus.APPLIED and caps:
            self.metrics.set_capacities(node, caps)
        if request.tier_kv_counts:
            total = 0
            for c in request.tier_kv_counts:
                if c.tier in TIERS:
                    self.metrics.kv_live_count.labels(node, TIER_NAMES[c.tier]).set(c.count)
                    total += c.count
            self.metrics.kv_live_count_total.labels(node).set(total)
        return response

    # ---- routing ----------------------------------------------------------------------
    @_handler
    def RoutePut(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._name("key", request.key)
        self._size("block_size", request.block_size)
        route = self.router.route_put(
            [request.key], [request.block_size], request.node_id, now_ms(), set(request.exclude_nodes)
        )[0]
        if route.already_exists:
            return pb.RoutePutResponse(outcome=pb.ROUTE_PUT_OUTCOME_ALREADY_EXISTS)
        if not route.node_id:
            return pb.RoutePutResponse(outcome=pb.ROUTE_PUT_OUTCOME_UNAVAILABLE)
        self.metrics.route_put.labels(route.node_id).inc()
        return pb.RoutePutResponse(
            outcome=pb.ROUTE_PUT_OUTCOME_ROUTED,
            node_id=route.node_id,
            tier=cast(Any, route.tier),
            peer_address=route.peer_address,
        )

    @_handler
    def BatchRoutePut(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys = self._keys("keys", request.keys)
        if len(request.block_sizes) != len(keys):
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "keys and block_sizes must have the same length")
        for i, size in enumerate(request.block_sizes):
            self._size(f"block_sizes[{i}]", size)
        routes = self.router.route_put(
            keys, list(request.block_sizes), request.node_id, now_ms(), set(request.exclude_nodes)
        )
        response = pb.BatchRoutePutResponse()
        for route in routes:
            entry = response.entries.add()
            if route.already_exists:
                entry.outcome = pb.ROUTE_PUT_OUTCOME_ALREADY_EXISTS
            elif route.node_id:
                entry.outcome = pb.ROUTE_PUT_OUTCOME_ROUTED
                entry.node_id, entry.tier, entry.peer_address = route.node_id, route.tier, route.peer_address
                self.metrics.batch_route_put.labels(route.node_id).inc()
        return response

    @_handler
    def RouteGet(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._name("key", request.key)
        route = self.router.route_get([request.key], now_ms(), set(request.exclude_nodes))[0]
        if route is None:
            return pb.RouteGetResponse(found=False)
        loc = route.location
        self.metrics.route_get.labels(loc.node_id).inc()
        return pb.RouteGetResponse(
            found=True, node_id=loc.node_id, tier=cast(Any, loc.tier), size=loc.size, peer_address=route.peer_address
        )

    @_handler
    def BatchRouteGet(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys = self._keys("keys", request.keys)
        routes = self.router.route_get(keys, now_ms(), set(request.exclude_nodes))
        response = pb.BatchRouteGetResponse()
        refs: dict[tuple[str, str], int] = {}
        for route in routes:
            if route is None:
                response.node_ref.append(0)
                response.tier.append(pb.TIER_UNKNOWN)
                response.size.append(0)
                response.logical_tier.append("")
                continue
            loc = route.location
            ref = refs.get((loc.node_id, route.peer_address))
            if ref is None:
                response.nodes.add(node_id=loc.node_id, peer_address=route.peer_address)
                ref = refs[(loc.node_id, route.peer_address)] = len(response.nodes)
            response.node_ref.append(ref)
            response.tier.append(loc.tier)
            response.size.append(loc.size)
            response.logical_tier.append("")
            self.metrics.batch_route_get.labels(loc.node_id).inc()
        return response

    @_handler
    def BatchLookup(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys = self._keys("keys", request.keys)
        found = self.router.exists(keys, now_ms())
        return pb.BatchLookupResponse(found=found)

    @_handler
    def BatchLookupPacked(self, request: Any, context: grpc.ServicerContext) -> Any:
        keys = self._packed_keys("keys", request.keys)
        return pb.BatchLookupPackedResponse(found=bytes(self.router.exists(keys, now_ms())) if keys else b"")

    # ---- external KV ------------------------------------------------------------------
    def _ext_request(self, request: Any, *, hashes: bool = True) -> tuple[str, list[str], int]:
        self._node_id(request.node_id)
        tier = self._tier("tier", request.tier) if hasattr(request, "tier") else 0
        values: list[str] = []
        if hashes:
            if not request.hashes:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, "hashes must not be empty")
            values = self._keys("hashes", request.hashes)
            # "<prefix>:extkv:node:<node>" is a node's set of hashes in the Redis store.
            bad = next((i for i, h in enumerate(values) if h.startswith("node:")), None)
            if bad is not None:
                raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"hashes[{bad}] starts with 'node:'")
        return request.node_id, values, tier

    @_handler
    def ReportExternalKvBlocks(self, request: Any, context: grpc.ServicerContext) -> Any:
        node, hashes, tier = self._ext_request(request)
        tier_name = TIER_NAMES[tier]
        if not self.store.report_external_kv(node, hashes, tier):
            log.warning("[Master] ReportExternalKvBlocks from %s ignored: node not alive", node)
            # Any string can come here as a node id: one series for them all keeps the count bounded.
            self.metrics.ext_report.labels(UNREGISTERED, tier_name, "rejected_not_alive").inc()
            return pb.ReportExternalKvBlocksResponse()
        self.metrics.ext_report_blocks.labels(node, tier_name).inc(len(hashes))
        self.metrics.ext_report.labels(node, tier_name, "ok").inc()
        self.metrics.ext_live_count.labels(node).set(self.store.external_kv_count(node))
        return pb.ReportExternalKvBlocksResponse()

    def _after_revoke(self, node: str, tier_name: str, blocks: int | None) -> None:
        if self.store.get_client(node) is None:
            return  # a revoke for an unknown node creates no series
        if blocks is not None:
            self.metrics.ext_revoke_blocks.labels(node, tier_name).inc(blocks)
        self.metrics.ext_revoke.labels(node, tier_name, "ok").inc()
        self.metrics.ext_live_count.labels(node).set(self.store.external_kv_count(node))

    @_handler
    def RevokeExternalKvBlocks(self, request: Any, context: grpc.ServicerContext) -> Any:
        node, hashes, tier = self._ext_request(request)
        self.store.revoke_external_kv(node, hashes, tier)
        self._after_revoke(node, TIER_NAMES[tier], len(hashes))
        return pb.RevokeExternalKvBlocksResponse()

    @_handler
    def RevokeAllExternalKvBlocksAtTier(self, request: Any, context: grpc.ServicerContext) -> Any:
        node, _, tier = self._ext_request(request, hashes=False)
        self.store.revoke_external_kv_at_tier(node, tier)
        self._after_revoke(node, TIER_NAMES[tier], None)
        return pb.RevokeAllExternalKvBlocksAtTierResponse()

    @_handler
    def RevokeAllExternalKvBlocksForNode(self, request: Any, context: grpc.ServicerContext) -> Any:
        node, _, _ = self._ext_request(request, hashes=False)
        self.store.revoke_external_kv_for_node(node)
        self._after_revoke(node, "ALL", None)
        return pb.RevokeAllExternalKvBlocksForNodeResponse()

    @_handler
    def MatchExternalKv(self, request: Any, context: grpc.ServicerContext) -> Any:
        hashes = self._keys("hashes", request.hashes)
        matches = self.store.match_external_kv(hashes, bool(request.count_as_hit), now_ms())
        peers = {r.node_id: r.peer_address for r in self.router.alive_clients(now_ms()).values()}
        response = pb.MatchExternalKvResponse()
        matched = 0
        for node, by_tier in matches.items():
            m = response.matches.add(node_id=node, peer_address=peers.get(node, ""))
            for tier in sorted(by_tier):
                m.hashes_by_tier.add(tier=tier, hashes=by_tier[tier])
            matched += len({h for hs in by_tier.values() for h in hs})
        self.metrics.ext_match.inc()
        self.metrics.ext_match_queried.inc(len(hashes))
        self.metrics.ext_match_matched.inc(matched)
        return response

    @_handler
    def GetExternalKvHitCounts(self, request: Any, context: grpc.ServicerContext) -> Any:
        limit = self.settings.hit_query_max_batch
        if len(request.hashes) > limit:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"hashes size exceeds UMBP_HIT_QUERY_MAX_BATCH={limit}")
        hashes = self._keys("hashes", request.hashes)
        response = pb.GetExternalKvHitCountsResponse()
        for h, count in self.store.hit_counts(hashes):
            response.entries.add(hash=h, hit_count_total=count)
        return response

    # ---- client metrics ---------------------------------------------------------------
    @_handler
    def ReportMetrics(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._node_id(request.node_id)
        self._batch("metrics", request.metrics)
        record = self.store.get_client(request.node_id)
        if record is None:
            raise Rejected(grpc.StatusCode.NOT_FOUND, f"node {request.node_id!r} is not registered")
        samples = []
        try:
            for i, m in enumerate(request.metrics):
                labels = ReportedMetrics.labels_for(request.node_id, record.tags, [(x.name, x.value) for x in m.labels])
                which = m.WhichOneof("value")
                if which == "counter_delta":
                    samples.append(Sample("counter", m.name, m.help, labels, value=m.counter_delta))
                elif which == "gauge_value":
                    samples.append(Sample("gauge", m.name, m.help, labels, value=m.gauge_value))
                elif which == "histogram_aggregate":
                    a = m.histogram_aggregate
                    samples.append(
                        Sample(
                            "histogram",
                            m.name,
                            m.help,
                            labels,
                            bounds=tuple(a.bounds),
                            buckets=tuple(a.bucket_counts),
                            count=a.count,
                            total=a.sum,
                        )
                    )
                else:
                    raise ValueError(f"metrics[{i}] ({m.name!r}) carries no value")
            self.metrics.reported.apply(samples)
        except ValueError as e:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return pb.ReportMetricsResponse()
