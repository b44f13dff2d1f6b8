"""All-reduce benchmark, 4 GPUs under torchrun: mori.triton.all_reduce vs the seed's kernels, NCCL and
PyTorch symmetric memory, measured in the same run.

    torchrun --nproc_per_node=4 ci/device/bench_allreduce.py --out $OUT/bench_allreduce.json

Times are per call: CUDA events around a CUDA graph of ITERS calls (``graph``), or around ITERS
eager launches (``eager``: includes Python launch cost), median of REPEATS, max over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import traceback

import torch
import torch.distributed as dist

import mori.shmem as shmem
from mori.triton import AllReduce, install_hook, jit
from mori.triton._all_reduce import AllReduceConfig, default_config
from mori.triton.kernels import allreduce_p2p_kernel, allreduce_put_signal_kernel

ITERS, REPEATS = 20, 10
SIZES = [8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 64 * 7168 * 2, 2 << 20, 8 << 20, 32 << 20, 64 << 20]
VARIANTS = [AllReduceConfig(True, b, w, m) for b, w, ms in [(1024, 4, (16, 32, 64)), (2048, 8, (32, 64))] for m in ms]
VARIANTS += [AllReduceConfig(False, b, w, m) for b, w, ms in
             [(1024, 4, (32, 64, 128)), (2048, 4, (32, 64, 128)), (4096, 8, (64, 128, 256))] for m in ms]


def _time(fn, graph: bool) -> float:
    """Median microseconds per call over REPEATS runs of ITERS calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(ITERS):
                fn()
        run = g.replay
    samples = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            run()
        else:
            for _ in range(ITERS):
                run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / ITERS)
    value = torch.tensor([statistics.median(samples)], device="cuda")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _try(results: dict, key: str, fn, graph: bool) -> None:
    try:
        results[key] = round(_time(fn, graph), 2)
    except Exception as exc:  # a peer that cannot run here is reported, not fatal
        results[key] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
        if dist.get_rank() == 0:
            traceback.print_exc()
        torch.cuda.synchronize()


def bench_size(nbytes: int, op: AllReduce, world: int, rank: int, group_name: str, tune: bool) -> dict:
    n = nbytes // 2
    res: dict = {"bytes": nbytes}
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    _try(res, "mori_graph", lambda: op(x), True)
    _try(res, "mori_eager", lambda: op(x), False)
    cfg = default_config(nbytes, world)
    res["mori_config"] = f"{'1shot' if cfg.one_shot else '2shot'} b{cfg.block} w{cfg.num_warps} g{cfg.max_blocks}"
    if tune and nbytes <= 8 << 20:
        for v in VARIANTS:
            if v.one_shot and nbytes > op.one_shot_max_bytes:
                continue
            key = f"{'1shot' if v.one_shot else '2shot'} b{v.block} w{v.num_warps} g{v.max_blocks}"
            _try(res.setdefault("variants", {}), key, lambda v=v: op(x, cfg=v), True)
    # Kernel A: inputs already on the symmetric heap, read-only, so back-to-back launches are valid.
    sym = shmem.shmem_tensor((n,), torch.bfloat16)
    sym.copy_(x)
    out = torch.empty_like(sym)
    ka = jit(allreduce_p2p_kernel)
    _try(res, "kernel_a", lambda: ka[(_cdiv(n, 2048),)](sym, out, n, BLOCK=2048), True)
    # Kernel B: one call + the device barrier that must separate calls.
    if n % 8 == 0:
        recv = shmem.shmem_tensor((world, n), torch.bfloat16)
        sig = shmem.shmem_tensor((1,), torch.uint64)
        sig.zero_()
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        kb, epoch = jit(allreduce_put_signal_kernel), [0]

        def call_b():
            epoch[0] += 1
            kb[(world * 8,)](sym, recv, sig, out, n, epoch[0], CHUNKS_PER_PE=8, BLOCK=2048)
            shmem.shmem_barrier_on_stream(torch.cuda.current_stream())

        _try(res, "kernel_b_plus_barrier", call_b, False)
        shmem.shmem_barrier_all()
        shmem.shmem_free(sig.data_ptr())
        shmem.shmem_free(recv.data_ptr())
    shmem.shmem_barrier_all()
    shmem.shmem_free(sym.data_ptr())
    _try(res, "nccl_graph", lambda: dist.all_reduce(x), True)
    _try(res, "nccl_eager", lambda: dist.all_reduce(x), False)
    try:
        import torch.distributed._symmetric_memory as symm_mem

        t = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(t, group=group_name)
        t.copy_(x)
        _try(res, "symm_one_shot", lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group_name), True)
        _try(res, "symm_two_shot", lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group_name), True)
    except Exception as exc:
        res["symm_one_shot"] = res["symm_two_shot"] = f"error: {type(exc).__name__}: {exc}"[:100]
    return res


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fmt(v) -> str:
    return f"{v:9.2f}" if isinstance(v, float) else f"{'err':>9}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-tune", action="store_true", help="skip the per-size configuration sweep")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    shmem.shmem_torch_process_group_init("default")
    install_hook()
    rank, world = shmem.shmem_mype(), shmem.shmem_npes()
    op = AllReduce(max_bytes=max(SIZES), one_shot_max_bytes=2 << 20)  # lets the sweep try one-shot to 2 MiB
    rows = [bench_size(s, op, world, rank, dist.group.WORLD.group_name, not args.no_tune) for s in SIZES]
    if rank == 0:
        cols = ["mori_graph", "mori_eager", "kernel_a", "kernel_b_plus_barrier", "nccl_graph", "nccl_eager",
                "symm_one_shot", "symm_two_shot"]
        print(f"\nall-reduce bf16 sum, {world} GPUs, microseconds per call (graph = CUDA graph of {ITERS} calls)")
        print(f"{'bytes':>10} " + " ".join(f"{c[:9]:>9}" for c in cols) + "  mori config / best variant")
        for r in rows:
            best = min(((v, k) for k, v in r.get("variants", {}).items() if isinstance(v, float)), default=None)
            extra = r["mori_config"] + (f" | best {best[1]} {best[0]:.2f}" if best else "")
            print(f"{r['bytes']:>10} " + " ".join(_fmt(r.get(c)) for c in cols) + "  " + extra)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "iters": ITERS, "repeats": REPEATS, "rows": rows}, f, indent=1)
    op.close()
    shmem.shmem_finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
