"""MORI-EP's wider surface on GPUs (ops_gpu_worker.py with MORI_OPS_CHECKS=surface): the blockwise
fp8/fp4 combine quantizations, e4m3fnuz and packed fp4 expert outputs, routing handles (caching,
two dispatches in flight, replay, refusals) within a node and across nodes, the standard-MoE layout
and AUTO launch geometry, every PE's outputs gathered on rank 0 and checked there with the CPU
tests' references (test_ops_wire, test_ops_routing, ep_cases)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from ep_cases import Case
from test_ops_routing import (
    check_routing_refusals,
    check_routing_results,
    check_standard_moe_results,
    pe_routing_refusals,
    pe_routing_rounds,
    pe_standard_moe,
)
from test_ops_wire import (
    check_blockwise,
    check_fp4,
    check_within_moris_tolerance,
    pe_fp4_round,
    pe_quant_round,
)

import mori

__all__ = ["surface"]

#: Where the PEs' tensors live (the GPU checks; a dry run on the CPU heap sets "cpu").
DEVICE = "cuda"


def _gathered(obj: Any) -> list[Any] | None:
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _verdict(rank: int, what: str, check: Any) -> None:
    """Rank 0 runs ``check`` and prints ok / FAILED; every rank raises on a failure."""
    ok = True
    if rank == 0:
        try:
            check()
        except AssertionError as exc:
            print(f"FAILED  {what}: {exc}", flush=True)
            ok = False
        else:
            print(f"ok  {what}", flush=True)
    flag = [ok]
    dist.broadcast_object_list(flag, src=0)
    if not flag[0]:
        raise AssertionError(f"{what} failed")


def _packed(res: Any) -> Any:
    """Tensors as (uint8 bytes, dtype) for gather_object (torch cannot unpickle float8 storages)."""
    if isinstance(res, dict):
        return {k: _packed(v) for k, v in res.items()}
    if isinstance(res, list):
        return [_packed(v) for v in res]
    return ("t", res.contiguous().view(torch.uint8).cpu(), res.dtype) if isinstance(res, torch.Tensor) else res


def _unpacked(res: Any) -> Any:
    if isinstance(res, dict):
        return {k: _unpacked(v) for k, v in res.items()}
    if isinstance(res, list):
        return [_unpacked(v) for v in res]
    if isinstance(res, tuple) and len(res) == 3 and res[0] == "t":
        return res[1].view(res[2])
    return res


def gather(res: Any) -> Any:
    out = _gathered(_packed(res))
    return None if out is None else [_unpacked(r) for r in out]


def surface(rank: int, world: int) -> None:
    """Every check; with MORI_DISABLE_P2P (every PE a node of its own, reached through the device
    proxy) the ops are InterNodeV1 with gpu_per_node=1 (InterNodeV1LL for the standard-MoE layout).
    Routing handles here on IntraNode (with P2P); InterNodeV1's are checked between nodes by
    ops_gpu_worker.internode."""
    experts = max(1, 256 // world)
    p2p = os.environ.get("MORI_DISABLE_P2P", "").upper() not in ("1", "ON", "TRUE", "YES")
    kinds = mori.ops.EpDispatchCombineKernelType
    across: dict[str, Any] = {} if p2p else {"kernel_type": kinds.InterNodeV1, "gpu_per_node": 1}
    where = "" if p2p else " (InterNodeV1 through the proxy)"
    quant = Case(world=world, max_tokens=48, hidden=7168, k=8, experts_per_rank=experts, full=True)
    # The kernels' paths: blocks of 128 (16 lanes a block), 64 (8 lanes), 120 (15 of 16 lanes), 1024
    # (wider than a warp's packs), and 334 (not whole packs of 8: an element a lane).
    for q in ("fp8_blockwise", "fp4_blockwise"):
        for hidden, scale_dim in ((7168, 56), (7168, 112), (960, 8), (7168, 7), (1000, 3)):
            c = dataclasses.replace(quant, hidden=hidden, seed=scale_dim)
            res = gather(pe_quant_round(c, q, scale_dim, False, DEVICE, across))
            _verdict(
                rank,
                f"{q} combine{where}, hidden {c.hidden}, {scale_dim} scales: byte for byte as the numpy quantizer",
                lambda c=c, res=res, q=q, s=scale_dim: check_blockwise(c, res, q, s),
            )
        c = dataclasses.replace(quant, invalid=0.0, seed=5)
        res = gather(pe_quant_round(c, q, 56, True, DEVICE, across))
        _verdict(
            rank,
            f"{q} combine{where} within MORI's tolerance",
            lambda c=c, res=res, q=q: check_within_moris_tolerance(c, res, q, 56),
        )
    bf16 = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=experts, invalid=0.1)
    fp4 = dataclasses.replace(bf16, seed=21)
    res = gather(pe_fp4_round(fp4, DEVICE, across))
    _verdict(rank, f"packed fp4 (float4_e2m1fn_x2) combine input{where}", lambda: check_fp4(fp4, res))
    from ops_gpu_worker import rounds

    rounds(
        rank,
        world,
        f"fp8 e4m3fnuz combine input{where}",
        dataclasses.replace(bf16, dtype=torch.float8_e4m3fn, combine_dtype=torch.float8_e4m3fnuz),
        [22],
        **across,
    )
    os.environ["MORI_EP_LAUNCH_CONFIG_MODE"] = "AUTO"
    rounds(rank, world, f"bf16 under MORI_EP_LAUNCH_CONFIG_MODE=AUTO{where}", bf16, [23], **across)
    del os.environ["MORI_EP_LAUNCH_CONFIG_MODE"]
    # The standard-MoE layout (two passes: dispatch_standard_moe, and the converters).
    std = dataclasses.replace(bf16, max_tokens=9, hidden=256, experts_per_rank=3, seed=71)
    std_kind = {} if p2p else {"kernel_type": kinds.InterNodeV1LL, "gpu_per_node": 1}
    res = gather(pe_standard_moe(std, std_kind, DEVICE))
    _verdict(rank, f"standard-MoE layout{where.replace('V1', 'V1LL')}", lambda: check_standard_moe_results(std, res))
    if p2p:  # InterNodeV1's handles between nodes: ops_gpu_worker.internode
        routing_handles(rank, world, [("IntraNode", {})])


def routing_handles(rank: int, world: int, ops: list[tuple[str, dict[str, Any]]], where: str = "") -> None:
    """MORI's routing-handle checks, the replays and the refusals, on each op of ``ops`` (a kernel
    type's name and config fields), every result against the references of the CPU tests:
    a plain round against a routed one, two dispatches in flight combined each with its handle, a
    replay with new payloads and one with the first payloads (byte for byte that dispatch's
    outputs), and the refusals (a replay whose indices route differently changes nothing)."""
    kinds = mori.ops.EpDispatchCombineKernelType
    bf16 = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=max(1, 256 // world), invalid=0.1)
    for kernel, fields in ops:
        label = ", ".join([kernel, *(f"{k} {v}" for k, v in fields.items())]) + where
        for seed in (24, 26):
            c = dataclasses.replace(bf16, seed=seed)
            res = gather(pe_routing_rounds(c, kernel, DEVICE, replay=True, overrides=fields))
            _verdict(
                rank,
                f"routing handles ({label}) seed {seed}: parity with a plain round, two dispatches in "
                "flight, replays with new and with the first payloads",
                lambda c=c, res=res: check_routing_results(c, res, replay=True),
            )
        c = dataclasses.replace(bf16, seed=27, full=True)
        refusals = gather(pe_routing_refusals(c, DEVICE, {"kernel_type": kinds[kernel], **fields}))
        _verdict(
            rank,
            f"routing handles ({label}): refusals before anything is sent",
            lambda refusals=refusals: check_routing_refusals(refusals or []),
        )
