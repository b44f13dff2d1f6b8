"""Random requests of every kind against a master in its own process: each is answered, with OK
or a status that names the caller's mistake, never with an unhandled error; and afterwards the
master still serves, and what a well-formed client put in its index is still there."""

from __future__ import annotations

import contextlib

import grpc
import pytest
from _master_harness import redis_server, running_master
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mori.umbp._events import KvEvent, KvEventType
from mori.umbp._master._proto import umbp_pb2 as pb
from mori.umbp._master._proto import umbp_pb2_grpc as pb_grpc
from mori.umbp._master_client import EventBundle, MasterClient

#: What a bad request may be answered; UNKNOWN or INTERNAL would be a handler's crash.
CALLER_MISTAKES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
}

text = st.one_of(st.sampled_from(["", "n0", "n1", "k", "node:x", "a|b", "x:blocks"]), st.text(max_size=80))
big = st.integers(min_value=0, max_value=(1 << 64) - 1)
tier = st.integers(min_value=0, max_value=9)
caps = st.lists(
    st.builds(
        pb.TierCapacity, tier=tier, total_capacity_bytes=big, available_capacity_bytes=big, max_allocatable_bytes=big
    ),
    max_size=4,
)
event = st.builds(pb.KvEvent, kind=st.integers(0, 3), key=text, tier=tier, size=big)
bundle = st.builds(pb.EventBundle, seq=big, events=st.lists(event, max_size=5))
keys = st.lists(text, max_size=8)
sample = st.builds(
    pb.MetricSample,
    name=st.one_of(text, st.sampled_from(["mori_umbp_x", "mori_umbp_y_total", "mori_umbp_client_count"])),
    help=text,
    labels=st.lists(st.builds(pb.MetricLabel, name=text, value=text), max_size=3),
    gauge_value=st.floats(allow_nan=True),
)

REQUESTS = st.one_of(
    st.tuples(
        st.just("RegisterClient"),
        st.builds(
            pb.RegisterClientRequest,
            node_id=text,
            node_address=text,
            tier_capacities=caps,
            peer_address=text,
            tags=keys,
        ),
    ),
    st.tuples(st.just("UnregisterClient"), st.builds(pb.UnregisterClientRequest, node_id=text)),
    st.tuples(
        st.just("Heartbeat"),
        st.builds(
            pb.HeartbeatRequest,
            node_id=text,
            bundles=st.lists(bundle, max_size=3),
            is_full_sync=st.booleans(),
            tier_capacities=caps,
            delta_seq_baseline=big,
        ),
    ),
    st.tuples(
        st.just("RoutePut"), st.builds(pb.RoutePutRequest, key=text, node_id=text, block_size=big, exclude_nodes=keys)
    ),
    st.tuples(st.just("RouteGet"), st.builds(pb.RouteGetRequest, key=text, node_id=text, exclude_nodes=keys)),
    st.tuples(
        st.just("BatchRoutePut"),
        st.builds(pb.BatchRoutePutRequest, node_id=text, keys=keys, block_sizes=st.lists(big, max_size=8)),
    ),
    st.tuples(st.just("BatchRouteGet"), st.builds(pb.BatchRouteGetRequest, node_id=text, keys=keys)),
    st.tuples(st.just("BatchLookup"), st.builds(pb.BatchLookupRequest, node_id=text, keys=keys)),
    st.tuples(
        st.just("BatchLookupPacked"),
        st.builds(
            pb.BatchLookupPackedRequest,
            node_id=text,
            keys=st.one_of(st.binary(max_size=64), keys.map(lambda ks: "".join(k + "\0" for k in ks).encode())),
        ),
    ),
    st.tuples(
        st.just("ReportExternalKvBlocks"),
        st.builds(pb.ReportExternalKvBlocksRequest, node_id=text, hashes=keys, tier=tier),
    ),
    st.tuples(
        st.just("RevokeExternalKvBlocks"),
        st.builds(pb.RevokeExternalKvBlocksRequest, node_id=text, hashes=keys, tier=tier),
    ),
    st.tuples(
        st.just("RevokeAllExternalKvBlocksAtTier"),
        st.builds(pb.RevokeAllExternalKvBlocksAtTierRequest, node_id=text, tier=tier),
    ),
    st.tuples(
        st.just("RevokeAllExternalKvBlocksForNode"), st.builds(pb.RevokeAllExternalKvBlocksForNodeRequest, node_id=text)
    ),
    st.tuples(
        st.just("MatchExternalKv"), st.builds(pb.MatchExternalKvRequest, hashes=keys, count_as_hit=st.booleans())
    ),
    st.tuples(st.just("GetExternalKvHitCounts"), st.builds(pb.GetExternalKvHitCountsRequest, hashes=keys)),
    st.tuples(
        st.just("ReportMetrics"), st.builds(pb.ReportMetricsRequest, node_id=text, metrics=st.lists(sample, max_size=3))
    ),
)


@pytest.fixture(scope="module", params=["inmemory", "redis"])
def master(request, tmp_path_factory):
    with contextlib.ExitStack() as stack:
        env = {"UMBP_HEARTBEAT_TTL_SEC": "3600"}
        if request.param == "redis":
            uri = stack.enter_context(redis_server(tmp_path_factory.mktemp("redis")))
            env.update(UMBP_METADATA_BACKEND="redis", UMBP_REDIS_URI=uri)
        m = stack.enter_context(running_master(env))
        keeper = MasterClient(m.address, "keeper")
        keeper.register_client({2: (1 << 30, 1 << 30)})
        keeper.heartbeat([EventBundle(1, [KvEvent(KvEventType.ADD, "kept", 2, 4096, -1)])])
        yield m, pb_grpc.UMBPMasterStub(grpc.insecure_channel(m.address)), keeper


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=st.lists(REQUESTS, min_size=1, max_size=10))
def test_random_requests_get_answers_never_crashes(master, calls):
    _, stub, _ = master
    for rpc, request in calls:
        try:
            getattr(stub, rpc)(request, timeout=30)
        except grpc.RpcError as e:
            assert e.code() in CALLER_MISTAKES, f"{rpc}: {e.code()}: {e.details()}"


def test_the_master_still_serves_what_it_held(master):
    m, _, keeper = master
    assert keeper.batch_lookup(["kept"]) == [True]
    assert m.proc.poll() is None
