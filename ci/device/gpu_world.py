"""One PE per process under torchrun, on any number of GPUs: several PEs may share one GPU.

Every multi-PE GPU test and script of mori (shmem, triton, ops) starts its PEs through
:func:`init_world`, so that the same test runs with one GPU per PE on a multi-GPU host and with
several PEs on one GPU on a single-GPU host (correctness only there: see docs/shmem.md,
"Several PEs on one GPU").

- PE ``LOCAL_RANK`` uses GPU ``LOCAL_RANK % device_count``.
- The torch process group is ``cpu:gloo,cuda:nccl`` while each PE has a GPU of its own, plain
  ``gloo`` once PEs share one (NCCL refuses two ranks on one device). Tests therefore run their
  own collectives on CPU tensors, which both choices serve.
- The world group is registered as ``"default"``, as MORI's guide does, so that
  ``shmem_torch_process_group_init("default")`` finds it.
- A kernel that waits for its peers' kernels needs all of them resident at once under MPS: with
  :func:`pes_per_gpu` PEs on a GPU, each may hold only that share of the GPU's blocks.

``ci/device/*.sh`` choose the PE counts (``--pes "2 4"``) and start MPS when PEs share a GPU
(``ci/device/multi_pe.sh``). Tests import this module from ``ci/device`` (they put it on
``sys.path``; :data:`CI_DEVICE` is that folder).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CI_DEVICE", "gpus_shared", "init_world", "pe_device", "pes_per_gpu", "process_group_backend"]

CI_DEVICE = Path(__file__).resolve().parent


def _local() -> tuple[int, int]:
    try:
        return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except KeyError as exc:
        raise SystemExit(f"{exc.args[0]} is not set: start the PEs with torchrun (ci/device/*.sh)") from None


def pe_device() -> int:
    """The GPU index of this PE: ``LOCAL_RANK`` modulo the number of visible GPUs."""
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise SystemExit("no CUDA device is visible")
    return _local()[0] % count


def pes_per_gpu() -> int:
    """The most PEs of this host on one GPU (1 with a GPU per PE)."""
    import torch

    return -(-_local()[1] // max(1, torch.cuda.device_count()))


def gpus_shared() -> bool:
    """Whether this host's PEs outnumber its GPUs (some PEs share a GPU)."""
    return pes_per_gpu() > 1


def process_group_backend() -> str:
    """``cpu:gloo,cuda:nccl`` with a GPU per PE, ``gloo`` when PEs share GPUs."""
    return "gloo" if gpus_shared() else "cpu:gloo,cuda:nccl"


def init_world() -> tuple[int, int]:
    """Selects this PE's GPU, initializes torch.distributed and registers it as ``"default"``.

    Returns ``(rank, world_size)``. mori.shmem itself is not initialized here.
    """
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(pe_device())
    dist.init_process_group(backend=process_group_backend())
    torch._C._distributed_c10d._register_process_group("default", dist.group.WORLD)
    return dist.get_rank(), dist.get_world_size()
