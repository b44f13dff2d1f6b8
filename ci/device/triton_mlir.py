"""The seed's MLIR kernels (mori.triton.mlir) on GPUs, one process per PE, under torchrun.

Runs with any GPU count >= 1: PEs start through ``gpu_world.init_world`` (PE r on GPU
``r % device_count``, gloo when PEs share a GPU), so several PEs may share one GPU. The kernels
come prebuilt (``python -m mori.triton.mlir --arch sm_90 --out DIR --cubin`` on a machine with the
[mlir] extra): the GPU machine needs no MLIR. Checks, on every PE:

- ``shmem_basic_kernel`` writes ``[my_pe, n_pes]``;
- ``shmem_put_kernel``, ``ROUNDS`` times with a new value each: the symmetric int32 of this PE
  holds the value the previous PE ``(me - 1) % n`` put, and the words beside it are untouched.

Usage: torchrun --nproc_per_node=N ci/device/triton_mlir.py --kernels DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gpu_world import init_world  # beside this script (python puts its folder on sys.path)

ROUNDS = 3
GUARD = 0x5A5A5A5A  # the words around the target: a put that lands one word off shows up


def _value(pe: int, rnd: int) -> int:
    return pe * 1000 + rnd * 10 + 7


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kernels", type=Path, required=True, help="folder with shmem_*_kernel.cubin")
    args = parser.parse_args()

    import mori.shmem as shmem
    from mori.triton.mlir import IrModule

    init_world()
    shmem.shmem_torch_process_group_init("default")
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    stream = torch.cuda.current_stream().cuda_stream
    failures = []

    basic = IrModule((args.kernels / "shmem_basic_kernel.cubin").read_bytes())
    out = torch.full((2,), -1, dtype=torch.int32, device="cuda")
    basic.launch("shmem_basic_kernel", 1, 1, [(out.data_ptr(), "i64")], stream=stream)
    torch.cuda.synchronize()
    got = out.tolist()
    if got != [me, n]:
        failures.append(f"basic: got {got}, expected {[me, n]}")
    print(f"[PE {me}/{n}] shmem_basic_kernel -> {got}", flush=True)

    put = IrModule((args.kernels / "shmem_put_kernel.cubin").read_bytes())
    buf = shmem.shmem_tensor((3,), torch.int32)  # [guard, target, guard] on every PE
    prev = (me - 1) % n
    for rnd in range(ROUNDS):
        buf.fill_(GUARD)
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()  # every PE's buffer is reset before anyone puts
        put.launch("shmem_put_kernel", 1, 1, [(buf[1:].data_ptr(), "i64"), (_value(me, rnd), "i32")], stream=stream)
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()  # every put is complete (quiet) before anyone reads
        got = buf.tolist()
        expected = [GUARD, _value(prev, rnd), GUARD]
        if got != expected:
            failures.append(f"put round {rnd}: got {got}, expected {expected}")
        print(
            f"[PE {me}/{n}] shmem_put_kernel round {rnd}: buf[1] = {got[1]} (from PE {prev}: "
            f"{'ok' if got == expected else 'WRONG'})",
            flush=True,
        )

    shmem.shmem_barrier_all()
    shmem.shmem_free(buf.data_ptr())
    basic.unload()
    put.unload()
    counts = torch.tensor([1 + ROUNDS - len(failures), len(failures)])
    dist.all_reduce(counts)
    if me == 0:
        print(
            f"mlir kernels, {n} PEs on {torch.cuda.device_count()} GPU(s): "
            f"{counts[0].item()} passed, {counts[1].item()} failed"
        )
    for f in failures:
        print(f"[PE {me}] FAILED {f}", file=sys.stderr)
    shmem.shmem_finalize()
    dist.destroy_process_group()
    return 1 if counts[1].item() else 0


if __name__ == "__main__":
    raise SystemExit(main())
