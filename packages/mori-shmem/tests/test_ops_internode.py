"""mori.ops' inter-node kernel types on CPU PEs across two hosts (two network namespaces joined by a
veth pair, UCX on tcp), and on one host with MORI_DISABLE_P2P: the checks of the IntraNode CPU tests
(random routings with repeated and invalid expert ids, ranks that receive nothing, one rank
receiving every token, fp8 with scales), each round byte for byte against the reference, and the
same rounds byte-identical to IntraNode's on one host."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from ep_cases import Case, same_outputs
from pe_pool import PeError, PePool
from test_ops_cpu import BF16, HOT, _op, run
from test_remote import CPU_ENV, _across

import mori.shmem as shmem

CASES = {
    "bf16": (BF16, [1, 2]),
    "random-k7-invalid": (dataclasses.replace(BF16, k=7, invalid=0.3), [11]),
    "all-invalid": (dataclasses.replace(BF16, invalid=1.0), [12]),
    "hot-rank0": (HOT, [41]),
    "fp8-scales": (
        Case(world=0, max_tokens=8, hidden=64, k=6, experts_per_rank=2, dtype=torch.float8_e4m3fn, scale_dim=1),
        [5],
    ),
}


@pytest.fixture(scope="module")
def hosts() -> Iterator[PePool]:
    """2 + 2 CPU PEs in two namespaces."""
    spaces, _, pool = _across(2, {"MORI_SHMEM_HEAP_SIZE": "64M"})
    try:
        yield pool
    finally:
        pool.close()
        spaces.__exit__(None, None, None)


@pytest.fixture(scope="module")
def one_host() -> Iterator[PePool]:
    pool = PePool(4, {**CPU_ENV, "MORI_SHMEM_HEAP_SIZE": "64M"}, timeout=120)
    try:
        yield pool
    finally:
        pool.close()


@pytest.mark.parametrize("kernel", ["InterNodeV1", "InterNodeV1LL", "InterNode"])
@pytest.mark.parametrize("name", list(CASES))
def test_across_hosts_byte_identical_to_intranode(hosts: PePool, one_host: PePool, kernel: str, name: str) -> None:
    from mori.ops import EpDispatchCombineKernelType

    case, seeds = CASES[name]
    inter = run(hosts, case, seeds, overrides={"kernel_type": EpDispatchCombineKernelType[kernel]})
    intra = run(one_host, case, seeds)
    same_outputs(case, seeds, inter, intra)


@pytest.mark.parametrize("name", list(CASES))
def test_async_ll_across_hosts_byte_identical_to_intranode(hosts: PePool, one_host: PePool, name: str) -> None:
    """AsyncLL's send/recv halves with half the PEs on another host (their heaps reached through the
    remote transport): every round as IntraNode's on one host."""
    from mori.ops import EpDispatchCombineKernelType

    case, seeds = CASES[name]
    inter = run(hosts, case, seeds, overrides={"kernel_type": EpDispatchCombineKernelType.AsyncLL}, split=True)
    intra = run(one_host, case, seeds)
    same_outputs(case, seeds, inter, intra)


@pytest.mark.parametrize("quant", ["fp8_blockwise", "fp4_blockwise"])
def test_blockwise_combine_across_hosts(hosts: PePool, quant: str) -> None:
    """The quantized rows cross hosts as bytes (codes and scales) and are summed at the receiver:
    byte for byte as the numpy reference (test_ops_wire)."""
    from test_ops_wire import QUANT, check_blockwise, pe_quant_round

    from mori.ops import EpDispatchCombineKernelType

    case = dataclasses.replace(QUANT, world=hosts.n, hidden=100, seed=7, full=True)
    for kernel in (EpDispatchCombineKernelType.InterNodeV1, EpDispatchCombineKernelType.AsyncLL):
        check_blockwise(
            case, hosts.run(pe_quant_round, case, quant, 3, False, "cpu", {"kernel_type": kernel}), quant, 3
        )


def test_routing_handles_across_hosts(hosts: PePool) -> None:
    """InterNodeV1's routing handles (cache, two in flight, replay) with PEs on two hosts."""
    from test_ops_routing import test_routing_handles

    test_routing_handles(hosts, "InterNodeV1")


def test_standard_moe_across_hosts(hosts: PePool) -> None:
    from test_ops_routing import check_standard_moe

    from mori.ops import EpDispatchCombineKernelType

    check_standard_moe(hosts, kernel_type=EpDispatchCombineKernelType.InterNodeV1LL)


def pe_intranode_refused() -> str:
    from ep_cases import make_config

    import mori.ops

    try:
        mori.ops.EpDispatchCombineOp(
            make_config(dataclasses.replace(BF16, world=shmem.shmem_npes()), shmem.shmem_mype())
        )
    except ValueError as exc:
        return str(exc)
    return "built"


def test_intranode_across_hosts_refused(hosts: PePool) -> None:
    for pe, msg in enumerate(hosts.run(pe_intranode_refused)):
        assert "needs every PE's heap mapped; InterNodeV1, InterNodeV1LL or AsyncLL reach them" in msg, (pe, msg)


def test_disable_p2p_on_one_host_internode() -> None:
    from mori.ops import EpDispatchCombineKernelType

    pool = PePool(2, {**CPU_ENV, "MORI_SHMEM_HEAP_SIZE": "64M", "MORI_DISABLE_P2P": "ON"}, timeout=120)
    try:
        run(pool, BF16, [3, 4], overrides={"kernel_type": EpDispatchCombineKernelType.InterNodeV1LL})
        run(pool, BF16, [5], overrides={"kernel_type": EpDispatchCombineKernelType.AsyncLL}, split=True)
        with pytest.raises(PeError, match="InterNodeV1, InterNodeV1LL or AsyncLL reach them"):
            pool.run(_op, dataclasses.replace(BF16, world=2))
    finally:
        pool.close()
