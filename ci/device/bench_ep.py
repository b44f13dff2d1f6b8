"""MoE dispatch/combine benchmark: mori.ops beside NCCL all_to_all_single and PyTorch symmetric
memory's all_to_all_vdev and all_to_all_vdev_2d, on the same tokens and routing, in one run.

Shapes: decode (128 tokens per rank) and prefill (4096 tokens per rank), hidden 7168, top-8 of 256
experts, bf16 tokens and fp8 e4m3 tokens with per-128 float32 scales; combine takes bf16 expert
outputs, sent as they are or under a combine quantization (``--quants``: rows ``mori+fp8_blockwise``
and so on; their combine bandwidth still counts bf16 bytes, so a quantization shows as a higher
figure).
Times are CUDA-event medians per rank, then the slowest rank; bandwidth counts the token bytes a
rank sends to other ranks (one copy per distinct destination rank, as every method here sends
but ``symm_mem_2d``, which sends a copy per top-k entry: its GB/s counts the same bytes).
The peers' times include the layout step they need (sorting tokens by destination, exchanging
counts, and for NCCL the count read-back that sizes its splits). Runs under torchrun on any number
of GPUs; NCCL and symmetric memory need a GPU per rank and are reported as not run otherwise.
Row ``mori-async``: AsyncLL within one node. Rows ``mori-v1`` and ``mori-v1ll``: the InterNodeV1 and InterNodeV1LL kernels with the ranks split
into two nodes (``gpu_per_node = world / 2``; one rank a node with two ranks), the other node's
ranks reached through the device API's put-with-signal (a copy where their heap is mapped, mori.shmem's
remote transport where not: ``MORI_DISABLE_P2P``, another host).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
from gpu_world import gpus_shared, init_world

import mori

HIDDEN, TOPK, EXPERTS = 7168, 8, 256
#: The mori.ops rows: method name -> kernel type.
MORI_KINDS = {"mori": "IntraNode", "mori-async": "AsyncLL", "mori-v1": "InterNodeV1", "mori-v1ll": "InterNodeV1LL"}


def routing(n: int, world: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(n)]).to(torch.int32)


def timed(fn: Any, iters: int, warmup: int) -> list[float]:
    """Per-iteration milliseconds of ``fn`` (all ranks start each iteration together)."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def slowest(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def mori_pair(op: Any, x: Any, w: Any, s: Any, ids: Any, iters: int, warmup: int) -> tuple[float, float]:
    """Median dispatch and combine times of mori.ops (each call timed alone, in pairs)."""
    disp, comb = [], []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        tokens, _, _, _, _ = op.dispatch(x, w, s, ids)
        ev[1].record()
        y = tokens.to(torch.bfloat16) if tokens.dtype != torch.bfloat16 else tokens
        torch.cuda.synchronize()
        dist.barrier()
        ev[2].record()
        op.combine(y, None, ids)
        ev[3].record()
        ev[3].synchronize()
        if i >= warmup:
            disp.append(ev[0].elapsed_time(ev[1]))
            comb.append(ev[2].elapsed_time(ev[3]))
    return statistics.median(disp), statistics.median(comb)


def first_round(op: Any, x: Any, w: Any, s: Any, ids: Any) -> Any:
    """One untimed dispatch+combine; returns a bf16 combine input of the dispatch output's shape."""
    y = torch.empty(op.dispatch(x, w, s, ids)[0].shape, dtype=torch.bfloat16, device=x.device)
    op.combine(y, None, ids)
    return y


def back_to_back(dispatch: Any, combine: Any, iters: int, warmup: int) -> tuple[float, float, float]:
    """Rounds of ``dispatch()`` then ``combine()`` back to back, as a decode loop runs them: the
    ranks start together once, so launch skew between them is not timed (it falls on the warmup
    rounds). Median dispatch and combine ms (events between the calls) and median host ms of a
    round's Python (perf_counter)."""
    import time

    dist.barrier()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * (warmup + iters) + 1)]
    host = []
    ev[0].record()
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        dispatch()
        ev[2 * i + 1].record()
        combine()
        host.append(time.perf_counter() - t0)
        ev[2 * i + 2].record()
    ev[-1].synchronize()
    rounds = range(warmup, warmup + iters)
    disp = [ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in rounds]
    comb = [ev[2 * i + 1].elapsed_time(ev[2 * i + 2]) for i in rounds]
    return statistics.median(disp), statistics.median(comb), statistics.median(host[warmup:]) * 1e3


def mori_loop_pair(op: Any, x: Any, w: Any, s: Any, ids: Any, iters: int, warmup: int) -> tuple[float, float, float]:
    """Eager calls back to back, as a decode loop without graphs makes them: median dispatch and
    combine times, and the median host time of a dispatch+combine pair's Python, which bounds
    them from below when the host is the slower side."""
    y = first_round(op, x, w, s, ids)
    return back_to_back(lambda: op.dispatch(x, w, s, ids), lambda: op.combine(y, None, ids), iters, warmup)


def host_profile(op: Any, x: Any, w: Any, s: Any, ids: Any, rounds: int) -> str:
    """cProfile of ``rounds`` eager dispatch+combine pairs back to back (this rank's Python):
    where the host time of a call goes, the functions with the most time of their own first."""
    import cProfile
    import io
    import pstats

    y = first_round(op, x, w, s, ids)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        op.dispatch(x, w, s, ids)
        op.combine(y, None, ids)
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    return out.getvalue()


def mori_graph_pair(
    op: Any, x: Any, w: Any, s: Any, ids: Any, iters: int, warmup: int, zero_copy: bool = False
) -> tuple[float, float]:
    """Median dispatch and combine times of mori.ops captured as two CUDA graphs (as an engine's
    decode step runs them), replayed back to back; no host code is timed. ``zero_copy``: the
    expert outputs are in the op's registered combine input buffer
    (``get_registered_combine_input_buffer``), so combine copies nothing."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g_disp, g_comb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(g_disp, stream=stream):
            tokens = op.dispatch(x, w, s, ids)[0]
        if zero_copy:
            y = op.get_registered_combine_input_buffer(torch.bfloat16, tokens.shape[1])
        else:
            y = torch.empty(tokens.shape, dtype=torch.bfloat16, device=tokens.device).copy_(tokens)
        with torch.cuda.graph(g_comb, stream=stream):
            op.combine(y, None, ids)
    torch.cuda.current_stream().wait_stream(stream)
    disp, comb, _ = back_to_back(g_disp.replay, g_comb.replay, iters, warmup)
    return disp, comb


def kernel_profile(op: Any, x: Any, w: Any, s: Any, ids: Any, iters: int) -> list[tuple[str, int, float, float]]:
    """Where an eager dispatch+combine's time goes, from torch.profiler (CUPTI): per kernel and per
    host call, (name, calls, mean device us, mean host us) over ``iters`` rounds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            with torch.profiler.record_function("mori.dispatch"):
                tokens = op.dispatch(x, w, s, ids)[0]
            y = tokens.to(torch.bfloat16) if tokens.dtype != torch.bfloat16 else tokens
            torch.cuda.synchronize()
            dist.barrier()
            with torch.profiler.record_function("mori.combine"):
                op.combine(y, None, ids)
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if e.key.startswith("ep_") or e.key.startswith("mori.") or e.key.startswith("cuLaunchKernel"):
            rows.append((e.key, e.count, dev / max(1, e.count), e.cpu_time_total / max(1, e.count)))
    return sorted(rows)


def layout(ids: Any, world: int) -> tuple[Any, Any]:
    """The peers' layout step: (token, destination) pairs sorted by destination, and counts."""
    pe = ids.long() // (EXPERTS // world)
    first = torch.ones_like(pe, dtype=torch.bool)
    for j in range(1, TOPK):
        first[:, j] = (pe[:, :j] != pe[:, j : j + 1]).all(dim=1)
    tok = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1).expand_as(pe)[first]
    dest = pe[first]
    order = torch.argsort(dest, stable=True)
    return tok[order], torch.bincount(dest, minlength=world)


def nccl_pair(x: Any, ids: Any, world: int, group: Any, iters: int, warmup: int) -> tuple[float, float]:
    """NCCL all_to_all_single dispatch (layout + count exchange + tokens) and combine (tokens back
    + index_add into the source rows)."""
    row = x.view(torch.uint8).view(x.shape[0], -1)
    state: dict[str, Any] = {}

    def dispatch() -> None:
        tok, counts = layout(ids, world)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
        out = torch.empty(sum(recv_splits), row.shape[1], dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(out, row.index_select(0, tok), recv_splits, send_splits, group=group)
        state.update(tok=tok, send=send_splits, recv=recv_splits, out=out)

    def combine() -> None:
        back = torch.empty(len(state["tok"]), HIDDEN, dtype=torch.bfloat16, device=x.device)
        y = state["y"]
        dist.all_to_all_single(back, y, state["send"], state["recv"], group=group)
        acc = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
        acc.index_add_(0, state["tok"], back.float())
        state["combined"] = acc.to(torch.bfloat16)

    disp = timed(dispatch, iters, warmup)
    state["y"] = torch.randn(state["out"].shape[0], HIDDEN, device=x.device).to(torch.bfloat16)
    comb = timed(combine, iters, warmup)
    return statistics.median(disp), statistics.median(comb)


def symm_mem_ops(*names: str) -> tuple[Any, list[Any]] | str:
    """PyTorch symmetric memory on its NVSHMEM backend and its ops ``names``, or why not."""
    try:
        import torch.distributed._symmetric_memory as symm_mem

        ops = [getattr(torch.ops.symm_mem, name) for name in names]
        symm_mem.set_backend("NVSHMEM")
    except (AttributeError, RuntimeError, ImportError) as exc:
        return f"not run: {type(exc).__name__}: {str(exc)[:80]}"
    return symm_mem, ops


def symm_mem_pair(x: Any, ids: Any, world: int, iters: int, warmup: int) -> tuple[float, float] | str:
    """PyTorch symmetric memory all_to_all_vdev (NVSHMEM backend), if this torch has it. Two
    signatures: (input, out, in_out_splits[3, world], group) in older torch, and (input, out,
    in_splits[world], out_splits_offsets[2, world], group) in newer (2.11 has it), told apart by the schema."""
    found = symm_mem_ops("all_to_all_vdev")
    if isinstance(found, str):
        return found
    symm_mem, (op,) = found
    separate = len(op.default._schema.arguments) == 5  # in_splits and out_splits_offsets apart
    group_name = dist.group.WORLD.group_name
    row = x.view(torch.uint8).view(x.shape[0], -1)
    cap = x.shape[0] * world
    inp = symm_mem.empty(x.shape[0] * TOPK, row.shape[1], dtype=torch.uint8, device=x.device)
    out = symm_mem.empty(cap, row.shape[1], dtype=torch.uint8, device=x.device)
    back_in = symm_mem.empty(cap, HIDDEN, dtype=torch.bfloat16, device=x.device)
    back_out = symm_mem.empty(x.shape[0] * TOPK, HIDDEN, dtype=torch.bfloat16, device=x.device)
    # Per direction (dispatch, combine): the splits tensors the op takes, symmetric like its data.
    shapes = [(world,), (2, world)] if separate else [(3, world)]
    splits = [[symm_mem.empty(*shape, dtype=torch.int64, device=x.device) for shape in shapes] for _ in range(2)]
    for t in (inp, out, back_in, back_out, *splits[0], *splits[1]):
        symm_mem.rendezvous(t, group_name)
    state: dict[str, Any] = {}

    def sent(direction: int) -> Any:  # the splits this rank sends (row 0 of the old form)
        return splits[direction][0] if separate else splits[direction][0][0]

    def received(direction: int) -> Any:  # the splits it received, which the op fills in
        return splits[direction][1][0] if separate else splits[direction][0][1]

    def dispatch() -> None:
        tok, counts = layout(ids, world)
        inp[: len(tok)].copy_(row.index_select(0, tok))
        sent(0).copy_(counts)
        op(inp, out, *splits[0], group_name)
        state["tok"] = tok

    def combine() -> None:
        sent(1).copy_(received(0))
        op(back_in, back_out, *splits[1], group_name)
        acc = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32, device=x.device)
        acc.index_add_(0, state["tok"], back_out[: len(state["tok"])].float())

    disp = timed(dispatch, iters, warmup)
    comb = timed(combine, iters, warmup)
    return statistics.median(disp), statistics.median(comb)


def symm_mem_2d_pair(x: Any, ids: Any, world: int, iters: int, warmup: int) -> tuple[float, float] | str:
    """PyTorch symmetric memory's MoE form, all_to_all_vdev_2d and all_to_all_vdev_2d_offset (NVSHMEM
    backend): a row per top-k entry (not one per destination rank), sent sorted by expert and
    received grouped by local expert; combine sends the expert outputs back the same way (the
    offsets dispatch returned) and sums each token's rows."""
    found = symm_mem_ops("all_to_all_vdev_2d", "all_to_all_vdev_2d_offset")
    if isinstance(found, str):
        return found
    symm_mem, (to_experts, back) = found
    group_name = dist.group.WORLD.group_name
    n, entries = x.shape[0], x.shape[0] * TOPK
    row = x.view(torch.uint8).view(n, -1)
    per_expert = torch.bincount(ids.flatten().long().cpu(), minlength=EXPERTS)
    dist.all_reduce(per_expert)  # every rank's entries per expert: the most any rank receives
    cap = int(per_expert.view(world, -1).sum(dim=1).max())
    inp = symm_mem.empty(entries, row.shape[1], dtype=torch.uint8, device=x.device)
    out = symm_mem.empty(cap, row.shape[1], dtype=torch.uint8, device=x.device)
    back_in = symm_mem.empty(cap, HIDDEN, dtype=torch.bfloat16, device=x.device)
    back_out = symm_mem.empty(entries, HIDDEN, dtype=torch.bfloat16, device=x.device)
    in_splits = symm_mem.empty(EXPERTS, dtype=torch.int64, device=x.device)
    splits_offsets = [symm_mem.empty(2, EXPERTS, dtype=torch.int64, device=x.device) for _ in range(3)]
    for t in (inp, out, back_in, back_out, in_splits, *splits_offsets):
        symm_mem.rendezvous(t, group_name)
    received, back_in_splits, back_out_splits = splits_offsets
    state: dict[str, Any] = {}

    def dispatch() -> None:
        flat = ids.flatten().long()
        order = torch.argsort(flat, stable=True)  # by global expert: by rank, then local expert
        inp[:entries].copy_(row.index_select(0, order // TOPK))
        in_splits.copy_(torch.bincount(flat, minlength=EXPERTS))
        to_experts(inp, out, in_splits, received, group_name)
        state["tok"] = order // TOPK

    def combine() -> None:
        back_in_splits.copy_(received)
        back(back_in, back_out, back_in_splits, back_out_splits, group_name)
        acc = torch.zeros(n, HIDDEN, dtype=torch.float32, device=x.device)
        acc.index_add_(0, state["tok"], back_out[:entries].float())

    disp = timed(dispatch, iters, warmup)
    comb = timed(combine, iters, warmup)
    return statistics.median(disp), statistics.median(comb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_ep.json")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--shapes", default="decode,prefill")
    ap.add_argument("--blocks", type=int, default=80, help="mori.ops block_num")
    ap.add_argument(
        "--zero-copy",
        action="store_true",
        help="with --graph, also time combine from the registered input buffer (+graph+zc)",
    )
    ap.add_argument("--host-profile", action="store_true", help="cProfile the decode rows' eager calls (rank 0)")
    ap.add_argument("--warps", type=int, default=16, help="mori.ops warp_num_per_block")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="also time mori.ops rows as eager calls back to back (+loop) and CUDA graph replays (+graph)",
    )
    ap.add_argument("--profile", action="store_true", help="print a per-kernel profile of each mori.ops row (rank 0)")
    ap.add_argument("--methods", default=",".join(MORI_KINDS), help="mori.ops rows to run (of %(default)s)")
    ap.add_argument(
        "--quants",
        default="none,fp8_direct_cast,fp8_blockwise,fp4_blockwise",
        help="combine quant_type of the mori.ops rows (rows other than 'none' are named method+quant)",
    )
    args = ap.parse_args()
    # The symmetric-memory peers' buffers on NVSHMEM's heap: the prefill shape's 2d rows (a copy
    # per top-k entry, there and back) take about 2 GB beside the 1d op's 1.2 GB.
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")
    rank, world = init_world()
    mori.shmem.shmem_torch_process_group_init("default")
    shared = gpus_shared()
    nccl_group = None if shared else dist.new_group(backend="nccl")
    rows, shapes = [], {"decode": 128, "prefill": 4096}
    for shape in args.shapes.split(","):
        n = shapes[shape]
        ids = routing(n * world, world, 7)[rank * n : (rank + 1) * n].cuda()
        _, counts = layout(ids, world)
        remote = int(counts.sum() - counts[rank])
        for dtype in ("bf16", "fp8"):
            torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
            scale_dim = 0 if dtype == "bf16" else HIDDEN // 128
            x = torch.randn(n, HIDDEN, device="cuda").to(torch_dtype)
            w = torch.rand(n, TOPK, device="cuda")
            s = torch.rand(n, scale_dim, device="cuda") if scale_dim else None
            peers: dict[str, Any] = {}
            for method, quant in [(m, q) for m in args.methods.split(",") for q in args.quants.split(",")]:
                cfg = mori.ops.EpDispatchCombineConfig(
                    data_type=torch_dtype,
                    rank=rank,
                    world_size=world,
                    hidden_dim=HIDDEN,
                    scale_dim=scale_dim,
                    scale_type_size=4,
                    max_token_type_size=2,
                    max_num_inp_token_per_rank=n,
                    num_experts_per_rank=EXPERTS // world,
                    num_experts_per_token=TOPK,
                    warp_num_per_block=args.warps,
                    block_num=args.blocks,
                    kernel_type=mori.ops.EpDispatchCombineKernelType[MORI_KINDS[method]],
                    # The inter-node rows split the ranks into two nodes; the others keep one node.
                    gpu_per_node=max(1, world // 2) if method.startswith("mori-v1") else world,
                    quant_type=quant,
                )
                op = mori.ops.EpDispatchCombineOp(cfg)
                d, c = mori_pair(op, x, w, s, ids, args.iters, args.warmup)
                name = method if quant == "none" else f"{method}+{quant}"
                peers[name] = (slowest(d), slowest(c))
                if args.profile:
                    try:
                        prof = kernel_profile(op, x, w, s, ids, args.iters)
                    except Exception as exc:  # a profiler that cannot run does not stop the benchmark
                        prof = [(f"profiler failed: {type(exc).__name__}: {str(exc)[:80]}", 0, 0.0, 0.0)]
                    if rank == 0:
                        print(f"profile {shape} {dtype} {name}: kernel/call, calls, device us, host us")
                        for key, count, dev_us, host_us in prof:
                            print(f"  {key:40} {count:5} {dev_us:9.1f} {host_us:9.1f}")
                if args.host_profile and rank == 0 and shape == "decode" and quant == "none":
                    print(f"host profile {shape} {dtype} {name}, 200 pairs:")
                    print(host_profile(op, x, w, s, ids, 200))
                elif args.host_profile and shape == "decode" and quant == "none":
                    host_profile(op, x, w, s, ids, 200)  # the peer's half of the same rounds
                if args.graph:
                    ld, lc, lh = mori_loop_pair(op, x, w, s, ids, args.iters, args.warmup)
                    peers[name + "+loop"] = (slowest(ld), slowest(lc))
                    host_us = slowest(lh) * 1e3
                    if rank == 0:
                        print(
                            f"host time of {shape} {dtype} {name} dispatch+combine (eager, back to back): {host_us:.1f} us"
                        )
                    gd, gc = mori_graph_pair(op, x, w, s, ids, args.iters, args.warmup)
                    peers[name + "+graph"] = (slowest(gd), slowest(gc))
                    if args.zero_copy and quant == "none":
                        gd, gc = mori_graph_pair(op, x, w, s, ids, args.iters, args.warmup, zero_copy=True)
                        peers[name + "+graph+zc"] = (slowest(gd), slowest(gc))
            disp_bytes = remote * x.shape[1] * x.element_size()
            comb_bytes = remote * HIDDEN * 2
            if shared:
                peers["nccl"] = peers["symm_mem"] = peers["symm_mem_2d"] = "not run: PEs share a GPU"
            else:
                nd, nc = nccl_pair(x, ids, world, nccl_group, args.iters, args.warmup)
                peers["nccl"] = (slowest(nd), slowest(nc))
                try:
                    sm = symm_mem_pair(x, ids, world, args.iters, args.warmup)
                except Exception as exc:  # a peer that fails is reported, the run goes on
                    sm = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
                peers["symm_mem"] = sm if isinstance(sm, str) else (slowest(sm[0]), slowest(sm[1]))
                try:
                    sm = symm_mem_2d_pair(x, ids, world, args.iters, args.warmup)
                except Exception as exc:  # a peer that fails is reported, the run goes on
                    sm = f"failed: {type(exc).__name__}: {str(exc)[:100]}"
                peers["symm_mem_2d"] = sm if isinstance(sm, str) else (slowest(sm[0]), slowest(sm[1]))
            for name, res in peers.items():
                row = {
                    "shape": shape,
                    "tokens_per_rank": n,
                    "dtype": dtype,
                    "method": name,
                    "world": world,
                    "gpus_shared": shared,
                }
                if isinstance(res, str):
                    row["note"] = res
                else:
                    row.update(
                        dispatch_us=res[0] * 1e3,
                        combine_us=res[1] * 1e3,
                        dispatch_GBps=disp_bytes / (res[0] * 1e-3) / 1e9,
                        combine_GBps=comb_bytes / (res[1] * 1e-3) / 1e9,
                    )
                rows.append(row)
    if rank == 0:
        print(
            f"mori.ops dispatch/combine, {world} ranks{' sharing GPUs (correctness only)' if shared else ''}, "
            f"hidden {HIDDEN}, top-{TOPK} of {EXPERTS}; mori.ops {args.blocks} blocks x {args.warps} warps; "
            f"slowest rank's median of {args.iters}"
        )
        print(f"{'shape':8} {'dtype':5} {'method':22} {'dispatch us':>12} {'GB/s':>7} {'combine us':>11} {'GB/s':>7}")
        for r in rows:
            if "note" in r:
                print(f"{r['shape']:8} {r['dtype']:5} {r['method']:22} {r['note']}")
            else:
                print(
                    f"{r['shape']:8} {r['dtype']:5} {r['method']:22} {r['dispatch_us']:12.1f} "
                    f"{r['dispatch_GBps']:7.1f} {r['combine_us']:11.1f} {r['combine_GBps']:7.1f}"
                )
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    mori.shmem.shmem_finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
