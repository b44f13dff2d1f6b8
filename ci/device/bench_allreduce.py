"""All-reduce benchmark, 4 GPUs under torchrun: mori.triton.all_reduce vs the seed's kernels, NCCL and
PyTorch symmetric memory, measured in the same run.

    torchrun --nproc_per_node=4 ci/device/bench_allreduce.py --out $OUT/bench_allreduce.json

Times are per call: CUDA events around a CUDA graph of ITERS calls (``graph``), or around ITERS
eager launches (``eager``: includes Python launch cost), median of REPEATS, max over ranks.
ITERS is 100: the ranks leave the barrier before each timed run at different moments and the
first calls of a run absorb that skew; with graphs of 20 calls, two timings of one configuration
in one run differed by up to 30 % at the small sizes.
Every mori configuration (the default and each swept variant) is checked bit for bit against
the fp32 rank-order sum, before and after its timing runs, on every rank; a wrong one is
reported as FAILED and never proposed. The last table proposes DEFAULT_TABLE rows.
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
from mori.triton import (
    AllReduce,
    AllReduceConfig,
    all_reduce_sweep,
    default_all_reduce_config,
    install_hook,
    jit,
)
from mori.triton.kernels import allreduce_p2p_kernel, allreduce_put_signal_kernel

ITERS, REPEATS = 100, 10
SIZES = [8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 64 * 7168 * 2, 2 << 20, 8 << 20, 32 << 20, 64 << 20]
FAILED = "FAILED"


def _inputs(seed: int, n: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's random bf16 input and the exact reference (fp32 sum in rank order), no communication."""
    xs = [
        torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed * 64 + r)).to(
            torch.bfloat16
        )
        for r in range(world)
    ]
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()
    return xs[rank], acc.to(torch.bfloat16)


def _agree(ok: bool) -> bool:
    """True when every rank says ok."""
    flag = torch.tensor([1 if ok else 0], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _checked(results: dict, key: str, op: AllReduce, x, y, ref, cfg: AllReduceConfig | None) -> None:
    """Times op(x, out=y, cfg) in a graph; FAILED unless y is exact before and after the timing."""
    error = None
    try:
        y.zero_()
        op(x, out=y, cfg=cfg)
        torch.cuda.synchronize()
        ok = torch.equal(y.view(torch.int16), ref.view(torch.int16))
    except Exception as exc:  # every rank still takes part in _agree below
        error, ok = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", False
    if not _agree(ok):
        results[key] = error or FAILED
        return
    _try(results, key, lambda: op(x, out=y, cfg=cfg), True)
    torch.cuda.synchronize()
    if not _agree(torch.equal(y.view(torch.int16), ref.view(torch.int16))):  # the graph's last call
        results[key] = FAILED


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
    x, ref = _inputs(nbytes, n, world, rank)
    y = torch.empty_like(x)
    _checked(res, "mori_graph", op, x, y, ref, None)
    _try(res, "mori_eager", lambda: op(x, out=y), False)
    res["mori_config"] = default_all_reduce_config(nbytes, world).label
    if tune:
        for v in all_reduce_sweep(nbytes):
            if not (v.one_shot and nbytes > op.one_shot_max_bytes):
                _checked(res.setdefault("variants", {}), v.label, op, x, y, ref, v)
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
    return f"{v:9.2f}" if isinstance(v, float) else f"{FAILED if v == FAILED else 'err':>9}"


def _report(rows: list[dict]) -> None:
    """Every variant at every size (FAILED/err marked), then the best correct one per size."""
    labels = list(dict.fromkeys(k for r in rows for k in r.get("variants", {})))
    if not labels:
        return
    swept = [r for r in rows if "variants" in r]
    print("\nvariants, graph us per call (FAILED: wrong result, never proposed)")
    print(f"{'variant':>26} " + " ".join(f"{r['bytes']:>9}" for r in swept))
    for lab in labels:
        print(
            f"{lab:>26} " + " ".join(_fmt(r["variants"][lab]) if lab in r["variants"] else f"{'-':>9}" for r in swept)
        )
    print("\nproposed DEFAULT_TABLE rows (best correct variant per size; compare nccl_graph)")
    for r in swept:
        best = min(((v, k) for k, v in r["variants"].items() if isinstance(v, float)), default=None)
        nccl = r.get("nccl_graph")
        if best:
            print(f"{r['bytes']:>10}  {best[1]:<26} {best[0]:8.2f} us   nccl {_fmt(nccl)}")
        failed = [k for k, v in r["variants"].items() if v == FAILED]
        if failed:
            print(f"{'':>10}  FAILED: {', '.join(failed)}")


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
        cols = [
            "mori_graph",
            "mori_eager",
            "kernel_a",
            "kernel_b_plus_barrier",
            "nccl_graph",
            "nccl_eager",
            "symm_one_shot",
            "symm_two_shot",
        ]
        print(f"\nall-reduce bf16 sum, {world} GPUs, microseconds per call (graph = CUDA graph of {ITERS} calls)")
        print(f"{'bytes':>10} " + " ".join(f"{c[:9]:>9}" for c in cols) + "  mori config")
        for r in rows:
            print(f"{r['bytes']:>10} " + " ".join(_fmt(r.get(c)) for c in cols) + "  " + r["mori_config"])
        _report(rows)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "iters": ITERS, "repeats": REPEATS, "rows": rows}, f, indent=1)
    op.close()
    shmem.shmem_finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
