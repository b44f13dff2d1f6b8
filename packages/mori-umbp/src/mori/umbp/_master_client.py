"""MasterClient: the client side of the UMBP master's gRPC service.

It has MORI's ``UMBPMasterClient`` methods (register_self, report/revoke/match external KV,
hit counts) and the calls a peer makes (register, heartbeat with KvEvents, route put/get,
lookup). Every call carries a deadline; a failed call raises :class:`MasterError` (a
``RuntimeError``, as MORI's binding raises), and an unreachable master or a missed deadline
raises :class:`MasterUnavailableError`.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

from . import _grpc
from ._enums import UMBPTierType
from ._env import runtime_int
from ._events import KvEvent
from ._external import UMBPExternalKvHitCountEntry, UMBPExternalKvMatch
from ._master._proto import umbp_pb2 as pb
from ._master._proto import umbp_pb2_grpc as pb_grpc

#: Default deadline of each call, in seconds.
DEFAULT_TIMEOUT_S = 5.0
#: The largest answer the client takes (a batch's routes for the largest batch the master allows).
_MAX_ANSWER_BYTES = 64 << 20
#: Each RPC's answer type, for the C++ transport (grpcio's stub knows them itself).
_RESPONSES = _grpc.response_types(pb, "UMBPMaster")


class MasterError(RuntimeError):
    """A master call failed; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class MasterUnavailableError(MasterError):
    """The master could not be reached, or did not answer before the call's deadline."""


@dataclasses.dataclass(frozen=True)
class EventBundle:
    """KvEvents shipped under one sequence number; bundles of a node count up from 1."""

    seq: int
    events: Sequence[KvEvent]


class NodeStatus(enum.IntEnum):
    """A node as the master sees it (MORI's ``ClientStatus``)."""

    UNKNOWN = 0
    ALIVE = 1
    EXPIRED = 2


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
    """``status`` UNKNOWN: the master does not know the node (re-register and send a full
    sync). ``request_full_sync``: the master saw a sequence gap."""

    status: NodeStatus
    acked_seq: int
    request_full_sync: bool


class RoutePutOutcome(enum.IntEnum):
    """A put's routing: no node has room, routed, or a live node holds the key already."""

    UNAVAILABLE = 0
    ROUTED = 1
    ALREADY_EXISTS = 2


@dataclasses.dataclass(frozen=True)
class PutRoute:
    """Where to write a block; ``node_id`` is empty unless ``outcome`` is ROUTED."""

    outcome: RoutePutOutcome
    node_id: str = ""
    tier: UMBPTierType = UMBPTierType.Unknown
    peer_address: str = ""


@dataclasses.dataclass(frozen=True)
class BlockLocation:
    """Where to read a block: the owning node, its tier, the block's size, and the node's
    peer service address."""

    node_id: str
    tier: UMBPTierType
    size: int
    peer_address: str


def _wire_tier(tier: Any) -> Any:
    """A tier as the wire carries it: its number. Proto3 enums are open, so any int passes here
    and the master checks it (an unknown tier is refused with INVALID_ARGUMENT)."""
    return int(tier)


def _caps(tier_capacities: Mapping[Any, Any]) -> list[Any]:
    """``{tier: (total, available)}`` or ``{tier: (total, available, max_allocatable)}``."""
    out = []
    for tier, value in tier_capacities.items():
        total, available, *rest = value
        out.append(
            pb.TierCapacity(
                tier=_wire_tier(tier),
                total_capacity_bytes=int(total),
                available_capacity_bytes=int(available),
                max_allocatable_bytes=int(rest[0]) if rest else 0,
            )
        )
    return out


class MasterClient:
    """A connection to one UMBP master.

    Construction does not contact the master (as in MORI); the first call does. ``node_id``
    and ``node_address`` name this node for :meth:`register_self` and the peer calls.
    ``timeout_s`` is each call's deadline.
    """

    def __init__(
        self,
        master_address: str,
        node_id: str = "",
        node_address: str = "",
        *,
        peer_address: str = "",
        engine_desc: bytes = b"",
        tags: Iterable[str] = (),
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not master_address:
            raise ValueError("master_address must not be empty (host:port of the UMBP master)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.master_address = master_address
        self.node_id = node_id
        self.node_address = node_address
        self.peer_address = peer_address
        self.engine_desc = engine_desc
        self.tags = list(tags)
        self.timeout_s = timeout_s
        native = _grpc.native()
        self._native = None if native is None else _grpc.NativeChannel(native, master_address, _MAX_ANSWER_BYTES)
        if self._native is None:
            self._channel = grpc.insecure_channel(
                master_address, options=[("grpc.max_receive_message_length", _MAX_ANSWER_BYTES)]
            )
            self._stub = pb_grpc.UMBPMasterStub(self._channel)
        self._registered = False
        self._lock = threading.Lock()
        #: Whether the master answers BatchLookupPacked (until it says UNIMPLEMENTED).
        self._packed_lookup = True

    # ---- plumbing ---------------------------------------------------------------------
    def _call(self, rpc: str, request: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            if self._native is not None:
                return self._native.unary(f"/umbp.UMBPMaster/{rpc}", request, _RESPONSES[rpc], timeout)
            return getattr(self._stub, rpc)(request, timeout=timeout)
        except _grpc.RpcFailure as e:
            code, details = e.code, e.details
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise MasterUnavailableError(
                f"UMBP master at {self.master_address} is unreachable: {rpc} got {code.name} "
                f"within its {timeout:g} s deadline ({details})",
                code,
            ) from None
        raise MasterError(f"UMBP master at {self.master_address}: {rpc} failed: {code.name}: {details}", code) from None

    def _need_node(self) -> str:
        if not self.node_id:
            raise ValueError("this MasterClient has no node_id; pass node_id= to the constructor")
        return self.node_id

    def close(self) -> None:
        """Closes the channel; later calls fail."""
        if self._native is not None:
            self._native.close()
        else:
            self._channel.close()

    def __enter__(self) -> MasterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- registration -----------------------------------------------------------------
    def register_client(self, tier_capacities: Mapping[Any, Any]) -> int:
        """Registers this node with its capacities ``{tier: (total, available[, max_allocatable])}``;
        returns the recommended heartbeat interval in milliseconds. Raises MasterError
        (ALREADY_EXISTS) when a live node with this id is registered."""
        request = pb.RegisterClientRequest(
            node_id=self._need_node(),
            node_address=self.node_address,
            tier_capacities=_caps(tier_capacities),
            peer_address=self.peer_address,
            engine_desc=self.engine_desc,
            tags=self.tags,
        )
        response = self._call("RegisterClient", request)
        with self._lock:
            self._registered = True
        return int(response.heartbeat_interval_ms)

    def register_self(self, tier_capacities: Mapping[Any, Any]) -> None:
        """MORI's name for :meth:`register_client`."""
        self.register_client(tier_capacities)

    def unregister_self(self) -> None:
        """Unregisters this node; its blocks and external-KV hashes leave the index. Raises
        RuntimeError when this client has not registered."""
        with self._lock:
            if not self._registered:
                raise MasterError(
                    f"node {self.node_id!r} is not registered by this client", grpc.StatusCode.FAILED_PRECONDITION
                )
        # MORI bounds the goodbye by UMBP_RPC_SHUTDOWN_TIMEOUT_MS rather than the usual deadline.
        timeout_s = runtime_int("UMBP_RPC_SHUTDOWN_TIMEOUT_MS", 3000, 1) / 1000
        self._call("UnregisterClient", pb.UnregisterClientRequest(node_id=self._need_node()), timeout_s)
        with self._lock:
            self._registered = False

    def is_registered(self) -> bool:
        with self._lock:
            return self._registered

    # ---- heartbeat --------------------------------------------------------------------
    def heartbeat(
        self,
        bundles: Sequence[EventBundle] = (),
        *,
        tier_capacities: Mapping[Any, Any] | None = None,
        full_sync: bool = False,
        seq_baseline: int = 0,
        tier_kv_counts: Mapping[Any, int] | None = None,
    ) -> HeartbeatReply:
        """Proves liveness and ships KvEvents: an ADD commits a block to the global index, a
        REMOVE takes it out. Delta bundles must continue the node's sequence (first bundle =
        last acked + 1). ``full_sync``: the node's blocks become exactly the ADDs of
        ``bundles``, and ``seq_baseline`` becomes its sequence cursor."""
        request = pb.HeartbeatRequest(
            node_id=self._need_node(),
            is_full_sync=full_sync,
            delta_seq_baseline=seq_baseline,
            tier_capacities=_caps(tier_capacities or {}),
        )
        for bundle in bundles:
            b = request.bundles.add(seq=bundle.seq)
            for e in bundle.events:
                b.events.add(kind=int(e.type), key=e.key, tier=int(e.tier), size=e.size)
        for tier, count in (tier_kv_counts or {}).items():
            request.tier_kv_counts.add(tier=_wire_tier(tier), count=count)
        r = self._call("Heartbeat", request)
        return HeartbeatReply(NodeStatus(r.status), int(r.acked_seq), bool(r.request_full_sync))

    # ---- routing ----------------------------------------------------------------------
    def route_put(self, key: str, block_size: int, exclude_nodes: Iterable[str] = ()) -> PutRoute:
        """Which node (and tier) should store a new block of ``block_size`` bytes."""
        r = self._call(
            "RoutePut",
            pb.RoutePutRequest(key=key, node_id=self.node_id, block_size=block_size, exclude_nodes=list(exclude_nodes)),
        )
        return PutRoute(RoutePutOutcome(r.outcome), r.node_id, UMBPTierType(r.tier), r.peer_address)

    def batch_route_put(
        self, keys: Sequence[str], block_sizes: Sequence[int], exclude_nodes: Iterable[str] = ()
    ) -> list[PutRoute]:
        r = self._call(
            "BatchRoutePut",
            pb.BatchRoutePutRequest(
                node_id=self.node_id, keys=list(keys), block_sizes=list(block_sizes), exclude_nodes=list(exclude_nodes)
            ),
        )
        return [
            PutRoute(RoutePutOutcome(e.outcome), e.node_id, UMBPTierType(e.tier), e.peer_address) for e in r.entries
        ]

    def route_get(self, key: str, exclude_nodes: Iterable[str] = ()) -> BlockLocation | None:
        """Where to read ``key`` from, or None when no live node holds it."""
        r = self._call("RouteGet", pb.RouteGetRequest(key=key, node_id=self.node_id, exclude_nodes=list(exclude_nodes)))
        if not r.found:
            return None
        return BlockLocation(r.node_id, UMBPTierType(r.tier), int(r.size), r.peer_address)

    def batch_route_get(self, keys: Sequence[str], exclude_nodes: Iterable[str] = ()) -> list[BlockLocation | None]:
        r = self._call(
            "BatchRouteGet",
            pb.BatchRouteGetRequest(node_id=self.node_id, keys=list(keys), exclude_nodes=list(exclude_nodes)),
        )
        out: list[BlockLocation | None] = []
        for ref, tier, size in zip(r.node_ref, r.tier, r.size):
            if ref == 0:
                out.append(None)
                continue
            node = r.nodes[ref - 1]
            out.append(BlockLocation(node.node_id, UMBPTierType(tier), int(size), node.peer_address))
        return out

    def batch_lookup(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held by a live node (no read lease, no access bump). Asked with
        ``BatchLookupPacked``; a master without it (MORI's) is asked with ``BatchLookup``."""
        keys = list(keys)
        if not keys:
            return []
        found: Any = None
        if self._packed_lookup:
            packed = _grpc.pack_keys(keys)
            if packed is None:
                joined = "\0".join(keys)
                if joined.count("\0") == len(keys) - 1:  # else a key holds NUL: the packed form cannot carry it
                    packed = (joined + "\0").encode()
            if packed is not None:
                request = pb.BatchLookupPackedRequest(node_id=self.node_id, keys=packed)
                try:
                    found = self._call("BatchLookupPacked", request).found
                except MasterError as e:
                    if e.code != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    self._packed_lookup = False
        if found is None:
            found = self._call("BatchLookup", pb.BatchLookupRequest(node_id=self.node_id, keys=keys)).found
        if len(found) != len(keys):
            raise MasterError(
                f"UMBP master at {self.master_address}: asked about {len(keys)} keys, it answered {len(found)}",
                grpc.StatusCode.INTERNAL,
            )
        return list(map(bool, found))

    def lookup(self, key: str) -> bool:
        return self.batch_lookup([key])[0]

    # ---- external KV ------------------------------------------------------------------
    def report_external_kv_blocks(self, node_id: str, hashes: Sequence[str], tier: Any) -> None:
        """Additive: ``node_id`` now holds ``hashes`` at ``tier``. Ignored by the master when the
        node is not registered and alive."""
        self._call(
            "ReportExternalKvBlocks",
            pb.ReportExternalKvBlocksRequest(node_id=node_id, hashes=list(hashes), tier=_wire_tier(tier)),
        )

    def revoke_external_kv_blocks(self, node_id: str, hashes: Sequence[str], tier: Any) -> None:
        self._call(
            "RevokeExternalKvBlocks",
            pb.RevokeExternalKvBlocksRequest(node_id=node_id, hashes=list(hashes), tier=_wire_tier(tier)),
        )

    def revoke_all_external_kv_blocks_at_tier(self, node_id: str, tier: Any) -> None:
        self._call(
            "RevokeAllExternalKvBlocksAtTier",
            pb.RevokeAllExternalKvBlocksAtTierRequest(node_id=node_id, tier=_wire_tier(tier)),
        )

    def revoke_all_external_kv_blocks_for_node(self, node_id: str) -> None:
        self._call("RevokeAllExternalKvBlocksForNode", pb.RevokeAllExternalKvBlocksForNodeRequest(node_id=node_id))

    def match_external_kv(self, hashes: Sequence[str], count_as_hit: bool = False) -> list[UMBPExternalKvMatch]:
        """Nodes holding any of ``hashes``, each with its hashes by tier (tiers in ascending
        order, fastest first). ``count_as_hit`` only on the real request-routing path."""
        if not hashes:
            return []
        r = self._call("MatchExternalKv", pb.MatchExternalKvRequest(hashes=list(hashes), count_as_hit=count_as_hit))
        return [
            UMBPExternalKvMatch(
                m.node_id,
                m.peer_address,
                {UMBPTierType(b.tier): list(b.hashes) for b in sorted(m.hashes_by_tier, key=lambda b: b.tier)},
            )
            for m in r.matches
        ]

    def get_external_kv_hit_counts(self, hashes: Sequence[str]) -> list[UMBPExternalKvHitCountEntry]:
        """Lifetime hit counters of the hashes that have one (absent hashes are left out)."""
        r = self._call("GetExternalKvHitCounts", pb.GetExternalKvHitCountsRequest(hashes=list(hashes)))
        return [UMBPExternalKvHitCountEntry(e.hash, int(e.hit_count_total)) for e in r.entries]


#: MORI's name for it (``mori.cpp.UMBPMasterClient``).
UMBPMasterClient = MasterClient
