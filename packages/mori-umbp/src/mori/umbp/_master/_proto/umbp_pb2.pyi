from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TierType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNKNOWN: _ClassVar[TierType]
    TIER_HBM: _ClassVar[TierType]
    TIER_DRAM: _ClassVar[TierType]
    TIER_SSD: _ClassVar[TierType]

class ClientStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLIENT_STATUS_UNKNOWN: _ClassVar[ClientStatus]
    CLIENT_STATUS_ALIVE: _ClassVar[ClientStatus]
    CLIENT_STATUS_EXPIRED: _ClassVar[ClientStatus]

class RoutePutOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_PUT_OUTCOME_UNAVAILABLE: _ClassVar[RoutePutOutcome]
    ROUTE_PUT_OUTCOME_ROUTED: _ClassVar[RoutePutOutcome]
    ROUTE_PUT_OUTCOME_ALREADY_EXISTS: _ClassVar[RoutePutOutcome]
TIER_UNKNOWN: TierType
TIER_HBM: TierType
TIER_DRAM: TierType
TIER_SSD: TierType
CLIENT_STATUS_UNKNOWN: ClientStatus
CLIENT_STATUS_ALIVE: ClientStatus
CLIENT_STATUS_EXPIRED: ClientStatus
ROUTE_PUT_OUTCOME_UNAVAILABLE: RoutePutOutcome
ROUTE_PUT_OUTCOME_ROUTED: RoutePutOutcome
ROUTE_PUT_OUTCOME_ALREADY_EXISTS: RoutePutOutcome

class TierCapacity(_message.Message):
    __slots__ = ("tier", "total_capacity_bytes", "available_capacity_bytes", "max_allocatable_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ALLOCATABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: TierType
    total_capacity_bytes: int
    available_capacity_bytes: int
    max_allocatable_bytes: int
    def __init__(self, tier: _Optional[_Union[TierType, str]] = ..., total_capacity_bytes: _Optional[int] = ..., available_capacity_bytes: _Optional[int] = ..., max_allocatable_bytes: _Optional[int] = ...) -> None: ...

class RegisterClientRequest(_message.Message):
    __slots__ = ("node_id", "node_address", "tier_capacities", "peer_address", "engine_desc", "tags")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITIES_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DESC_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_address: str
    tier_capacities: _containers.RepeatedCompositeFieldContainer[TierCapacity]
    peer_address: str
    engine_desc: bytes
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., tier_capacities: _Optional[_Iterable[_Union[TierCapacity, _Mapping]]] = ..., peer_address: _Optional[str] = ..., engine_desc: _Optional[bytes] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class RegisterClientResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "ack_seq", "supports_max_allocatable_bytes", "supports_logical_tiers")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    ACK_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_MAX_ALLOCATABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_LOGICAL_TIERS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    ack_seq: int
    supports_max_allocatable_bytes: bool
    supports_logical_tiers: bool
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., ack_seq: _Optional[int] = ..., supports_max_allocatable_bytes: _Optional[bool] = ..., supports_logical_tiers: _Optional[bool] = ...) -> None: ...

class UnregisterClientRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class UnregisterClientResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "key", "tier", "size", "logical_tier")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ADD: _ClassVar[KvEvent.Kind]
        REMOVE: _ClassVar[KvEvent.Kind]
    ADD: KvEvent.Kind
    REMOVE: KvEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_TIER_FIELD_NUMBER: _ClassVar[int]
    kind: KvEvent.Kind
    key: str
    tier: TierType
    size: int
    logical_tier: str
    def __init__(self, kind: _Optional[_Union[KvEvent.Kind, str]] = ..., key: _Optional[str] = ..., tier: _Optional[_Union[TierType, str]] = ..., size: _Optional[int] = ..., logical_tier: _Optional[str] = ...) -> None: ...

class EventBundle(_message.Message):
    __slots__ = ("seq", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class TierKvCount(_message.Message):
    __slots__ = ("tier", "count")
    TIER_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    tier: TierType
    count: int
    def __init__(self, tier: _Optional[_Union[TierType, str]] = ..., count: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "bundles", "is_full_sync", "tier_capacities", "delta_seq_baseline", "tier_kv_counts")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLES_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITIES_FIELD_NUMBER: _ClassVar[int]
    DELTA_SEQ_BASELINE_FIELD_NUMBER: _ClassVar[int]
    TIER_KV_COUNTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    bundles: _containers.RepeatedCompositeFieldContainer[EventBundle]
    is_full_sync: bool
    tier_capacities: _containers.RepeatedCompositeFieldContainer[TierCapacity]
    delta_seq_baseline: int
    tier_kv_counts: _containers.RepeatedCompositeFieldContainer[TierKvCount]
    def __init__(self, node_id: _Optional[str] = ..., bundles: _Optional[_Iterable[_Union[EventBundle, _Mapping]]] = ..., is_full_sync: _Optional[bool] = ..., tier_capacities: _Optional[_Iterable[_Union[TierCapacity, _Mapping]]] = ..., delta_seq_baseline: _Optional[int] = ..., tier_kv_counts: _Optional[_Iterable[_Union[TierKvCount, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("status", "acked_seq", "request_full_sync")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    status: ClientStatus
    acked_seq: int
    request_full_sync: bool
    def __init__(self, status: _Optional[_Union[ClientStatus, str]] = ..., acked_seq: _Optional[int] = ..., request_full_sync: _Optional[bool] = ...) -> None: ...

class RoutePutRequest(_message.Message):
    __slots__ = ("key", "node_id", "block_size", "exclude_nodes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    key: str
    node_id: str
    block_size: int
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., node_id: _Optional[str] = ..., block_size: _Optional[int] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RoutePutResponse(_message.Message):
    __slots__ = ("outcome", "node_id", "tier", "peer_address", "logical_tier")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_TIER_FIELD_NUMBER: _ClassVar[int]
    outcome: RoutePutOutcome
    node_id: str
    tier: TierType
    peer_address: str
    logical_tier: str
    def __init__(self, outcome: _Optional[_Union[RoutePutOutcome, str]] = ..., node_id: _Optional[str] = ..., tier: _Optional[_Union[TierType, str]] = ..., peer_address: _Optional[str] = ..., logical_tier: _Optional[str] = ...) -> None: ...

class RouteGetRequest(_message.Message):
    __slots__ = ("key", "node_id", "exclude_nodes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    key: str
    node_id: str
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[str] = ..., node_id: _Optional[str] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteGetResponse(_message.Message):
    __slots__ = ("found", "node_id", "tier", "size", "peer_address", "logical_tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    node_id: str
    tier: TierType
    size: int
    peer_address: str
    logical_tier: str
    def __init__(self, found: _Optional[bool] = ..., node_id: _Optional[str] = ..., tier: _Optional[_Union[TierType, str]] = ..., size: _Optional[int] = ..., peer_address: _Optional[str] = ..., logical_tier: _Optional[str] = ...) -> None: ...

class BatchRoutePutRequest(_message.Message):
    __slots__ = ("node_id", "keys", "block_sizes", "exclude_nodes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    block_sizes: _containers.RepeatedScalarFieldContainer[int]
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., block_sizes: _Optional[_Iterable[int]] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchRoutePutEntry(_message.Message):
    __slots__ = ("outcome", "node_id", "tier", "peer_address", "logical_tier")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_TIER_FIELD_NUMBER: _ClassVar[int]
    outcome: RoutePutOutcome
    node_id: str
    tier: TierType
    peer_address: str
    logical_tier: str
    def __init__(self, outcome: _Optional[_Union[RoutePutOutcome, str]] = ..., node_id: _Optional[str] = ..., tier: _Optional[_Union[TierType, str]] = ..., peer_address: _Optional[str] = ..., logical_tier: _Optional[str] = ...) -> None: ...

class BatchRoutePutResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[BatchRoutePutEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[BatchRoutePutEntry, _Mapping]]] = ...) -> None: ...

class BatchRouteGetRequest(_message.Message):
    __slots__ = ("node_id", "keys", "exclude_nodes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "peer_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ...) -> None: ...

class BatchRouteGetResponse(_message.Message):
    __slots__ = ("nodes", "node_ref", "tier", "size", "logical_tier")
    NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_REF_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_TIER_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    node_ref: _containers.RepeatedScalarFieldContainer[int]
    tier: _containers.RepeatedScalarFieldContainer[TierType]
    size: _containers.RepeatedScalarFieldContainer[int]
    logical_tier: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., node_ref: _Optional[_Iterable[int]] = ..., tier: _Optional[_Iterable[_Union[TierType, str]]] = ..., size: _Optional[_Iterable[int]] = ..., logical_tier: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchLookupRequest(_message.Message):
    __slots__ = ("node_id", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchLookupResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, found: _Optional[_Iterable[bool]] = ...) -> None: ...

class BatchLookupPackedRequest(_message.Message):
    __slots__ = ("node_id", "keys")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    keys: bytes
    def __init__(self, node_id: _Optional[str] = ..., keys: _Optional[bytes] = ...) -> None: ...

class BatchLookupPackedResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bytes
    def __init__(self, found: _Optional[bytes] = ...) -> None: ...

class MetricLabel(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class HistogramAggregate(_message.Message):
    __slots__ = ("bounds", "bucket_counts", "count", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    bucket_counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., bucket_counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum: _Optional[float] = ...) -> None: ...

class MetricSample(_message.Message):
    __slots__ = ("name", "help", "labels", "counter_delta", "gauge_value", "histogram_aggregate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HELP_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    COUNTER_DELTA_FIELD_NUMBER: _ClassVar[int]
    GAUGE_VALUE_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_AGGREGATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    help: str
    labels: _containers.RepeatedCompositeFieldContainer[MetricLabel]
    counter_delta: float
    gauge_value: float
    histogram_aggregate: HistogramAggregate
    def __init__(self, name: _Optional[str] = ..., help: _Optional[str] = ..., labels: _Optional[_Iterable[_Union[MetricLabel, _Mapping]]] = ..., counter_delta: _Optional[float] = ..., gauge_value: _Optional[float] = ..., histogram_aggregate: _Optional[_Union[HistogramAggregate, _Mapping]] = ...) -> None: ...

class ReportMetricsRequest(_message.Message):
    __slots__ = ("node_id", "metrics")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    metrics: _containers.RepeatedCompositeFieldContainer[MetricSample]
    def __init__(self, node_id: _Optional[str] = ..., metrics: _Optional[_Iterable[_Union[MetricSample, _Mapping]]] = ...) -> None: ...

class ReportMetricsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportExternalKvBlocksRequest(_message.Message):
    __slots__ = ("node_id", "hashes", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hashes: _containers.RepeatedScalarFieldContainer[str]
    tier: TierType
    def __init__(self, node_id: _Optional[str] = ..., hashes: _Optional[_Iterable[str]] = ..., tier: _Optional[_Union[TierType, str]] = ...) -> None: ...

class ReportExternalKvBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RevokeExternalKvBlocksRequest(_message.Message):
    __slots__ = ("node_id", "hashes", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    hashes: _containers.RepeatedScalarFieldContainer[str]
    tier: TierType
    def __init__(self, node_id: _Optional[str] = ..., hashes: _Optional[_Iterable[str]] = ..., tier: _Optional[_Union[TierType, str]] = ...) -> None: ...

class RevokeExternalKvBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RevokeAllExternalKvBlocksAtTierRequest(_message.Message):
    __slots__ = ("node_id", "tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tier: TierType
    def __init__(self, node_id: _Optional[str] = ..., tier: _Optional[_Union[TierType, str]] = ...) -> None: ...

class RevokeAllExternalKvBlocksAtTierResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RevokeAllExternalKvBlocksForNodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class RevokeAllExternalKvBlocksForNodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchExternalKvRequest(_message.Message):
    __slots__ = ("hashes", "count_as_hit")
    HASHES_FIELD_NUMBER: _ClassVar[int]
    COUNT_AS_HIT_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[str]
    count_as_hit: bool
    def __init__(self, hashes: _Optional[_Iterable[str]] = ..., count_as_hit: _Optional[bool] = ...) -> None: ...

class TierHashes(_message.Message):
    __slots__ = ("tier", "hashes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    tier: TierType
    hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tier: _Optional[_Union[TierType, str]] = ..., hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class ExternalKvNodeMatch(_message.Message):
    __slots__ = ("node_id", "peer_address", "hashes_by_tier")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HASHES_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    hashes_by_tier: _containers.RepeatedCompositeFieldContainer[TierHashes]
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., hashes_by_tier: _Optional[_Iterable[_Union[TierHashes, _Mapping]]] = ...) -> None: ...

class MatchExternalKvResponse(_message.Message):
    __slots__ = ("matches",)
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[ExternalKvNodeMatch]
    def __init__(self, matches: _Optional[_Iterable[_Union[ExternalKvNodeMatch, _Mapping]]] = ...) -> None: ...

class HitCountEntry(_message.Message):
    __slots__ = ("hash", "hit_count_total")
    HASH_FIELD_NUMBER: _ClassVar[int]
    HIT_COUNT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    hash: str
    hit_count_total: int
    def __init__(self, hash: _Optional[str] = ..., hit_count_total: _Optional[int] = ...) -> None: ...

class GetExternalKvHitCountsRequest(_message.Message):
    __slots__ = ("hashes",)
    HASHES_FIELD_NUMBER: _ClassVar[int]
    hashes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hashes: _Optional[_Iterable[str]] = ...) -> None: ...

class GetExternalKvHitCountsResponse(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[HitCountEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[HitCountEntry, _Mapping]]] = ...) -> None: ...
