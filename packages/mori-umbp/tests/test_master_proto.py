"""The checked-in protoc output under mori/umbp/_master/_proto is what gen_proto.py writes from
the .proto files now (grpcio-tools as pinned in ci/requirements-dev.txt), byte for byte; and the
service and message names are MORI's, so MORI's clients and this master speak to each other."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


def _gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto", PACKAGE / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_modules_match_a_fresh_protoc_run(tmp_path):
    gen = _gen_proto()
    fresh = gen.generate(tmp_path)
    assert len(fresh) == 3 * len(gen.PROTOS)  # _pb2.py, _pb2.pyi, _pb2_grpc.py of each
    for path in fresh:
        rel = path.relative_to(tmp_path)
        checked_in = PACKAGE / "src" / rel
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"{rel} is stale: run python packages/mori-umbp/gen_proto.py and commit the result"
        )


def test_wire_names_are_mori_s():
    from mori.umbp._master._proto import umbp_pb2, umbp_peer_pb2

    master = umbp_pb2.DESCRIPTOR.services_by_name["UMBPMaster"]
    assert master.full_name == "umbp.UMBPMaster"
    mori_s = {
        "RegisterClient",
        "UnregisterClient",
        "Heartbeat",
        "RouteGet",
        "RoutePut",
        "BatchRoutePut",
        "BatchRouteGet",
        "BatchLookup",
        "ReportExternalKvBlocks",
        "RevokeExternalKvBlocks",
        "RevokeAllExternalKvBlocksAtTier",
        "RevokeAllExternalKvBlocksForNode",
        "MatchExternalKv",
        "GetExternalKvHitCounts",
        "ReportMetrics",
    }
    # MORI's methods, and one of mori's own beside them (its client falls back to BatchLookup).
    assert set(master.methods_by_name) == mori_s | {"BatchLookupPacked"}
    assert umbp_peer_pb2.DESCRIPTOR.services_by_name["UMBPPeer"].methods_by_name["EvictKey"].full_name == (
        "umbp.UMBPPeer.EvictKey"
    )
    # Field numbers MORI's clients send.
    heartbeat = umbp_pb2.HeartbeatRequest.DESCRIPTOR.fields_by_name
    assert {
        n: heartbeat[n].number
        for n in ("node_id", "bundles", "is_full_sync", "tier_capacities", "delta_seq_baseline", "tier_kv_counts")
    } == {
        "node_id": 1,
        "bundles": 2,
        "is_full_sync": 3,
        "tier_capacities": 4,
        "delta_seq_baseline": 6,
        "tier_kv_counts": 7,
    }
    assert umbp_pb2.RegisterClientRequest.DESCRIPTOR.fields_by_name["tags"].number == 13
