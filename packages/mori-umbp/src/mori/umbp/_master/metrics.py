"""The master's Prometheus metrics, under MORI's names (``master_metrics.h``) where MORI has one.

Every series labelled by node is removed when the node leaves (unregister or expiry), so the
number of series stays bounded by the number of clients.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .reported import ReportedMetrics
from .store import TIER_NAMES, TierCapacity


class MasterMetrics:
    def __init__(self, max_reported_series: int = 16384) -> None:
        self.registry = r = CollectorRegistry()
        node_tier = ["node", "tier"]
        self.client_count = Gauge(
            "mori_umbp_client_count", "Number of alive clients registered with the master", registry=r
        )
        self.capacity_total = Gauge(
            "mori_umbp_client_capacity_total_bytes", "Total capacity bytes", node_tier, registry=r
        )
        self.capacity_available = Gauge(
            "mori_umbp_client_capacity_available_bytes", "Available capacity bytes", node_tier, registry=r
        )
        self.capacity_used = Gauge(
            "mori_umbp_client_capacity_used_bytes", "Used capacity bytes (total - available)", node_tier, registry=r
        )
        self.capacity_utilization = Gauge(
            "mori_umbp_client_capacity_utilization_ratio",
            "Capacity utilization ratio (used / total) in [0,1]",
            node_tier,
            registry=r,
        )
        self.kv_live_count = Gauge(
            "mori_umbp_client_kv_live_count",
            "Live KV key count owned by this client, reported by the client (per tier)",
            node_tier,
            registry=r,
        )
        self.kv_live_count_total = Gauge(
            "mori_umbp_client_kv_live_count_total",
            "Total live KV key count owned by this client (sum across tiers)",
            ["node"],
            registry=r,
        )
        self.route_put = Counter(
            "mori_umbp_client_route_put_total", "Total RoutePut calls targeting client", ["node"], registry=r
        )
        self.route_get = Counter(
            "mori_umbp_client_route_get_total", "Total RouteGet hits served by client", ["node"], registry=r
        )
        self.batch_route_put = Counter(
            "mori_umbp_client_batch_route_put_total",
            "Total BatchRoutePut entries targeting client",
            ["node"],
            registry=r,
        )
        self.batch_route_get = Counter(
            "mori_umbp_client_batch_route_get_total", "Total BatchRouteGet hits served by client", ["node"], registry=r
        )
        self.events_applied = Counter(
            "mori_umbp_heartbeat_events_applied_total",
            "KvEvents applied to GlobalBlockIndex via heartbeat",
            ["node"],
            registry=r,
        )
        self.seq_gap = Counter(
            "mori_umbp_heartbeat_seq_gap_total",
            "Heartbeats rejected due to seq gap (full sync requested)",
            ["node"],
            registry=r,
        )
        self.ext_report = Counter(
            "mori_umbp_external_kv_report_total",
            "Total number of ReportExternalKvBlocks API calls received by the master",
            ["node", "tier", "result"],
            registry=r,
        )
        self.ext_report_blocks = Counter(
            "mori_umbp_external_kv_report_blocks_total",
            "Total number of KV blocks received across all ReportExternalKvBlocks calls",
            node_tier,
            registry=r,
        )
        self.ext_revoke = Counter(
            "mori_umbp_external_kv_revoke_total",
            "Total number of RevokeExternalKvBlocks API calls received by the master",
            ["node", "tier", "result"],
            registry=r,
        )
        self.ext_revoke_blocks = Counter(
            "mori_umbp_external_kv_revoke_blocks_total",
            "Total number of KV blocks revoked across all RevokeExternalKvBlocks calls",
            node_tier,
            registry=r,
        )
        self.ext_match = Counter(
            "mori_umbp_external_kv_match_total",
            "Total number of MatchExternalKv API calls received by the master",
            registry=r,
        )
        self.ext_match_queried = Counter(
            "mori_umbp_external_kv_match_queried_blocks_total",
            "Total number of KV blocks queried across all MatchExternalKv calls",
            registry=r,
        )
        self.ext_match_matched = Counter(
            "mori_umbp_external_kv_match_matched_blocks_total",
            "Total number of KV blocks matched across all MatchExternalKv calls",
            registry=r,
        )
        self.ext_live_count = Gauge(
            "mori_umbp_external_kv_live_count", "Live external KV block count", ["node"], registry=r
        )
        # mori's own: the index size, refusals, expiries, eviction advice and handler latency.
        self.index_keys = Gauge("mori_umbp_master_index_keys", "Distinct keys in the global block index", registry=r)
        self.rejected = Counter(
            "mori_umbp_master_rejected_requests_total",
            "Requests refused by the master, by RPC and gRPC status code",
            ["rpc", "code"],
            registry=r,
        )
        self.expired_clients = Counter(
            "mori_umbp_master_expired_clients_total",
            "Clients removed by the reaper after missing heartbeats",
            registry=r,
        )
        self.evict_advised = Counter(
            "mori_umbp_master_evict_advised_keys_total",
            "Keys the eviction advisor sent to peers in EvictKey calls",
            node_tier,
            registry=r,
        )
        self.evict_failed = Counter(
            "mori_umbp_master_evict_dispatch_failures_total",
            "EvictKey calls to peers that failed",
            ["node"],
            registry=r,
        )
        self.rpc_latency = Histogram(
            "mori_umbp_master_rpc_latency_seconds", "Time the master spent handling each RPC", ["rpc"], registry=r
        )
        # Each node-labelled metric with its label names, to find a leaving node's series.
        by_node, ext = ["node"], ["node", "tier", "result"]
        self._node_series: list[tuple[Gauge | Counter, list[str]]] = [
            (self.capacity_total, node_tier),
            (self.capacity_available, node_tier),
            (self.capacity_used, node_tier),
            (self.capacity_utilization, node_tier),
            (self.kv_live_count, node_tier),
            (self.kv_live_count_total, by_node),
            (self.route_put, by_node),
            (self.route_get, by_node),
            (self.batch_route_put, by_node),
            (self.batch_route_get, by_node),
            (self.events_applied, by_node),
            (self.seq_gap, by_node),
            (self.ext_report, ext),
            (self.ext_report_blocks, node_tier),
            (self.ext_revoke, ext),
            (self.ext_revoke_blocks, node_tier),
            (self.ext_live_count, by_node),
            (self.evict_advised, node_tier),
            (self.evict_failed, by_node),
        ]

        # What clients report goes beside the master's own metrics, never over them.
        own = {family.name for family in r.collect()}
        self.reported = ReportedMetrics(max_reported_series, own)
        r.register(self.reported)

    def watch_index(self, key_count: Callable[[], float]) -> None:
        """Reads the index size at each scrape."""
        self.index_keys.set_function(key_count)

    def set_capacities(self, node_id: str, caps: dict[int, TierCapacity]) -> None:
        for tier, cap in caps.items():
            labels = (node_id, TIER_NAMES.get(tier, "unknown"))
            used = max(cap.total - cap.available, 0)
            self.capacity_total.labels(*labels).set(cap.total)
            self.capacity_available.labels(*labels).set(cap.available)
            self.capacity_used.labels(*labels).set(used)
            self.capacity_utilization.labels(*labels).set(used / cap.total if cap.total else 0.0)

    def forget_node(self, node_id: str) -> None:
        """Drops every series labelled with ``node_id``, the reported ones too."""
        self.reported.forget_node(node_id)
        for metric, names in self._node_series:
            children = {
                tuple(s.labels[n] for n in names)
                for family in metric.collect()
                for s in family.samples
                if s.labels.get("node") == node_id
            }
            for values in children:
                metric.remove(*values)

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serves ``/metrics`` over HTTP on ``port`` from a daemon thread."""
        start_http_server(port, addr=addr, registry=self.registry)
