"""mori.ops GPU tests: torchrun starts the PEs running ops_gpu_worker.py.

Marked ``gpu``: CPU CI deselects them; ``ci/device/ep.sh`` runs them. The PE counts come from
``MORI_TEST_PES`` (default "2 4 8"); PEs beyond the GPU count share GPUs (ci/device/gpu_world.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from test_gpu import TWO_HOSTS, _torchrun

PES = [int(n) for n in os.environ.get("MORI_TEST_PES", "2 4 8").split()]
pytestmark = pytest.mark.gpu


def _routing_handles_ok(out: str, ops: list[str]) -> None:
    """Every routing-handle check of ops_gpu_surface.routing_handles passed for each op label."""
    for label in ops:
        assert out.count(f"ok  routing handles ({label}) seed ") == 2, (label, out)
        assert f"ok  routing handles ({label}): refusals before anything is sent" in out, (label, out)


def _node_sizes(nproc: int) -> list[int]:
    """The gpu_per_node splits ops_gpu_worker.internode runs with P2P (two nodes or more)."""
    return [g for g in (nproc // 2, nproc // 4) if g >= 1]


@pytest.mark.parametrize("nproc", PES)
def test_dispatch_combine(nproc: int) -> None:
    out = _torchrun("ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G"})
    assert f"ok  all mori.ops checks with {nproc} PEs" in out


@pytest.mark.parametrize("nproc", PES)
def test_hot_experts_and_refused_second_dispatch(nproc: int) -> None:
    """Every token to one or two ranks (they receive more than max_num_inp_token_per_rank rows, the
    others none and combine empty expert outputs and weights), and second dispatches refused."""
    out = _torchrun("ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G", "MORI_OPS_CHECKS": "edge"})
    assert out.count("ok  hot ") == 7 and out.count(" second dispatches refused") == 2, out
    assert f"ok  all mori.ops checks with {nproc} PEs" in out


@pytest.mark.parametrize("nproc", PES)
def test_internode_byte_identical_to_intranode(nproc: int) -> None:
    """InterNodeV1, InterNodeV1LL and AsyncLL (send/recv halves) with the PEs split into nodes by
    gpu_per_node (the other nodes' PEs reached through the device API's put-with-signal): every
    round as IntraNode's; InterNodeV1's routing handles (caching, two in flight, replays,
    refusals) against the references."""
    out = _torchrun("ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G", "MORI_OPS_CHECKS": "internode"})
    assert "FAILED" not in out, out
    assert out.count("byte for byte as IntraNode") >= 20, out
    _routing_handles_ok(out, [f"InterNodeV1, gpu_per_node {g}" for g in _node_sizes(nproc)])
    assert f"ok  all mori.ops checks with {nproc} PEs" in out, out


@pytest.mark.parametrize("nproc", PES)
def test_internode_through_the_proxy_byte_identical_to_intranode(nproc: int, tmp_path: Any) -> None:
    """InterNodeV1 and InterNodeV1LL with MORI_DISABLE_P2P (gpu_per_node=1: every other PE reached
    through the device proxy on UCX, as on other hosts), every round byte for byte as IntraNode's
    with P2P for the same inputs (saved by a first run), and InterNodeV1's routing handles
    (caching, two in flight, replays, refusals) against the references. Needs a UCX with CUDA
    support (MORI_UCX_LIB: ci/device/ep.sh --proxy sets it)."""
    reference = str(tmp_path / f"intra_{nproc}.pt")
    env = {"MORI_SHMEM_HEAP_SIZE": "1G", "MORI_OPS_INTRA_REFERENCE": reference}
    out = _torchrun("ops_gpu_worker.py", nproc, {**env, "MORI_OPS_CHECKS": "intra_reference", "MORI_DISABLE_P2P": "0"})
    assert f"ok  IntraNode rounds of the inter-node cases saved to {reference}" in out, out
    out = _torchrun(
        "ops_gpu_worker.py",
        nproc,
        {
            **env,
            "MORI_OPS_CHECKS": "internode",
            "MORI_DISABLE_P2P": "ON",
            "UCX_TLS": os.environ.get("UCX_TLS", "tcp,cuda_copy,self"),
        },
        two_hosts=TWO_HOSTS,
    )
    assert "FAILED" not in out, out
    assert out.count("byte for byte as IntraNode") >= 20, out
    _routing_handles_ok(out, ["InterNodeV1, gpu_per_node 1, through the proxy"])
    assert f"ok  all mori.ops checks with {nproc} PEs" in out, out
    if TWO_HOSTS:
        # P2P within each namespace, the remote transport across: gpu_per_node of half the world
        # (the namespaces) and of a quarter (nodes inside a namespace, whose PEs are still mapped).
        out = _torchrun(
            "ops_gpu_worker.py",
            nproc,
            {**env, "MORI_OPS_CHECKS": "internode", "UCX_TLS": os.environ.get("UCX_TLS", "tcp,cuda_copy,self")},
            two_hosts=True,
        )
        assert "FAILED" not in out, out
        assert out.count("byte for byte as IntraNode") >= 20, out
        _routing_handles_ok(out, [f"InterNodeV1, gpu_per_node {g}" for g in _node_sizes(nproc)])
        assert f"ok  all mori.ops checks with {nproc} PEs" in out, out


@pytest.mark.parametrize("nproc", PES)
def test_ep_surface(nproc: int) -> None:
    """fp8 and fp4 blockwise combine (byte for byte as the numpy quantizer, and within MORI's
    tolerance), e4m3fnuz and packed fp4 expert outputs, IntraNode's routing handles (caching, two
    dispatches in flight, replays, refusals), the standard-MoE layout and AUTO launch geometry
    (ops_gpu_surface.py)."""
    out = _torchrun("ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G", "MORI_OPS_CHECKS": "surface"})
    assert "FAILED" not in out, out
    assert out.count("ok  ") >= 14, out
    _routing_handles_ok(out, ["IntraNode"])
    assert f"ok  all mori.ops checks with {nproc} PEs" in out, out


@pytest.mark.parametrize("nproc", PES)
def test_ep_surface_through_the_proxy(nproc: int) -> None:
    """The surface checks with MORI_DISABLE_P2P (every PE a node of its own, InterNodeV1 and
    InterNodeV1LL through mori.shmem's device proxy on UCX; two network namespaces with
    MORI_TEST_NETNS): the quantized rows cross between nodes as bytes."""
    out = _torchrun(
        "ops_gpu_worker.py",
        nproc,
        {
            "MORI_SHMEM_HEAP_SIZE": "1G",
            "MORI_OPS_CHECKS": "surface",
            "MORI_DISABLE_P2P": "ON",
            "UCX_TLS": os.environ.get("UCX_TLS", "tcp,cuda_copy,self"),
        },
        two_hosts=TWO_HOSTS,
    )
    assert "FAILED" not in out, out
    assert out.count("(InterNodeV1 through the proxy)") >= 8, out
    assert f"ok  all mori.ops checks with {nproc} PEs" in out, out


# Last of the file: the PEs end with their CUDA contexts unusable (a device trap).
@pytest.mark.parametrize("nproc", PES)
def test_dispatch_graph_replayed_twice_stops_on_device(nproc: int) -> None:
    """Two dispatches with no combine between them that bypass the host's check (CUDA graph
    replays) stop on the device with a message instead of racing on the peers' counters."""
    out = _torchrun(
        "ops_gpu_worker.py", nproc, {"MORI_SHMEM_HEAP_SIZE": "1G", "MORI_OPS_CHECKS": "graph_double_dispatch"}
    )
    assert "ok  dispatch and combine as two CUDA graphs" in out, out
    assert all(f"ok  rank {r}: dispatch graph replayed twice stopped on the device" in out for r in range(nproc)), out
    assert "dispatch called twice without a combine in between" in out, out
