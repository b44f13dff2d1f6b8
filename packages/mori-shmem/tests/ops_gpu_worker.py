"""mori.ops on GPUs, one PE per process under torchrun (any GPU count: PEs may share a GPU).

Each case runs several dispatch + combine rounds with new random routings (repeated calls on one
op), gathers every PE's outputs on rank 0 and checks them there against the PyTorch reference
(ep_cases.check_round: byte for byte; fp8 wires as the reference rounds them). Then CUDA-graph
replays with new tokens, then the port of MORI's EP checker. Prints one "ok" line per check.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from ep_cases import Case, check_round, expert_output, make_config, pe_round, rank_inputs
from gpu_world import init_world  # ci/device, on PYTHONPATH (test_gpu._torchrun)

import mori


def gather(obj: dict[str, Any]) -> list[Any] | None:
    """Every PE's results on rank 0. Tensors travel as uint8 bytes with their dtype (torch cannot
    unpickle float8 storages)."""
    packed = {k: (v.view(torch.uint8), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in obj.items()}
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(packed, out, dst=0)
    if out is None:
        return None
    return [{k: v[0].view(v[1]) if isinstance(v, tuple) else v for k, v in o.items()} for o in out]


def report(rank: int, what: str, results: list[Any] | None, case: Case, wire: Any = None) -> None:
    if rank == 0:
        assert results is not None
        try:
            n = check_round(case, results, wire)
        except AssertionError as exc:
            print(f"FAILED  {what}: {exc}", flush=True)
            raise
        print(f"ok  {what}: {n} tokens received in all", flush=True)
    dist.barrier()


def rounds(rank: int, world: int, name: str, case: Case, seeds: list[int], split: bool = False,
           zero_copy: bool = False, wire: Any = None, **overrides: Any) -> None:
    op = mori.ops.EpDispatchCombineOp(make_config(case, rank, **overrides))
    for seed in seeds:
        c = dataclasses.replace(case, seed=seed)
        res = pe_round(c, op, "cuda", split=split, zero_copy=zero_copy)
        report(rank, f"{name} seed {seed}", gather(res), c, wire)


def graph_rounds(rank: int, world: int, case: Case, seeds: list[int]) -> None:
    """Captures dispatch + experts + combine once, then replays it with each seed's tokens."""
    op = mori.ops.EpDispatchCombineOp(make_config(case, rank))
    first = rank_inputs(dataclasses.replace(case, seed=seeds[0]), rank, "cuda")
    static = {k: v.clone() for k, v in first.items() if v is not None}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tokens, weights, _, indices, total = op.dispatch(static["input"], static["weights"], None, static["indices"])
        y = expert_output(case, tokens, rank)
        combined, combined_w = op.combine(y, weights, static["indices"])
    for seed in seeds:
        c = dataclasses.replace(case, seed=seed)
        for k, v in rank_inputs(c, rank, "cuda").items():
            if v is not None:
                static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        n = int(total.item())
        res = {"src_pos": op.get_dispatch_src_token_pos().cpu().clone(), "total": n,
               "tokens": tokens[:n].cpu(), "weights": weights[:n].cpu(), "indices": indices[:n].cpu(), "scales": None,
               "combine_in": y[:n].cpu(), "combined": combined.cpu(), "combined_weights": combined_w.cpu()}
        dist.barrier()  # every PE read its outputs before any replays the next round
        report(rank, f"CUDA graph replay, seed {seed}", gather(res), c)


def main() -> None:
    rank, world = init_world()
    mori.shmem.shmem_torch_process_group_init("default")
    t0 = time.time()
    if os.environ.get("MORI_OPS_CHECKS", "all") == "all":
        cases(rank, world)
    checker(rank, world)
    dist.barrier()
    if rank == 0:
        print(f"ok  all mori.ops checks with {world} PEs in {time.time() - t0:.1f} s", flush=True)
    mori.shmem.shmem_finalize()
    dist.destroy_process_group()


def cases(rank: int, world: int) -> None:
    """Every case of the reference comparison, then the CUDA-graph replays."""
    experts = max(1, 256 // world)
    bf16 = Case(world=world, max_tokens=48, hidden=1024, k=8, experts_per_rank=experts, invalid=0.1)
    rounds(rank, world, "bf16 IntraNode", bf16, [1, 2, 3])
    rounds(rank, world, "fp8 e4m3 + per-token fp32 scale", dataclasses.replace(
        bf16, dtype=torch.float8_e4m3fn, scale_dim=1), [4, 5])
    rounds(rank, world, "fp8 e4m3 + per-128 fp32 scales", dataclasses.replace(
        bf16, dtype=torch.float8_e4m3fn, scale_dim=1024 // 128), [6, 7])
    rounds(rank, world, "fp8 e4m3 combine (fp8 expert outputs)", dataclasses.replace(
        bf16, dtype=torch.float8_e4m3fn, combine_dtype=torch.float8_e4m3fn, scale_dim=1), [8])
    rounds(rank, world, "float32", dataclasses.replace(bf16, dtype=torch.float32), [9])
    rounds(rank, world, "bf16 AsyncLL send/recv", bf16, [10, 11], split=True,
           kernel_type=mori.ops.EpDispatchCombineKernelType.AsyncLL)
    rounds(rank, world, "bf16 zero-copy combine", bf16, [12], zero_copy=True, use_external_inp_buf=False)
    rounds(rank, world, "bf16 fp8_direct_cast combine", bf16, [13], wire=torch.float8_e4m3fn,
           quant_type="fp8_direct_cast")
    rounds(rank, world, "bf16 hidden 7168 top-8, 128 tokens", dataclasses.replace(
        bf16, hidden=7168, max_tokens=128), [14])
    graph_rounds(rank, world, dataclasses.replace(bf16, full=True), [15, 16, 17])


def checker(rank: int, world: int) -> None:
    """The port of MORI's EP checker."""
    import mori_ep_checker

    experts = max(1, 256 // world)

    cfg = make_config(Case(world=world, max_tokens=32, hidden=4096, k=8, experts_per_rank=experts), rank,
                      max_token_type_size=4)
    op = mori.ops.EpDispatchCombineOp(cfg)
    for seed, sentinel in ((123, None), (124, None), (125, "every_other"), (126, "first_only")):
        try:
            n = mori_ep_checker.check(op, seed, sentinel)
        except Exception as exc:
            import traceback

            print(f"FAILED  MORI EP checker seed {seed} sentinel {sentinel} on rank {rank} at {time.time():.3f}: "
                  f"{exc!r}\n{traceback.format_exc()}", flush=True)
            raise
        if rank == 0:
            print(f"ok  MORI EP checker seed {seed} sentinel {sentinel}: rank 0 received {n}", flush=True)


if __name__ == "__main__":
    main()
