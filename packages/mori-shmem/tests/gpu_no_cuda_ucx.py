"""The GPU heap with MORI_DISABLE_P2P on a UCX without CUDA (2 PEs under torchrun; see
test_gpu.py, which points MORI_UCX_LIB at the machine's system UCX): init fails on every PE with
a ShmemError that names the UCX and what to install, instead of initializing and stopping a
kernel at its first put to a peer. Prints one line per PE."""

from __future__ import annotations

import sys

from gpu_world import init_world

import mori.shmem as shmem


def main() -> int:
    init_world()
    try:
        shmem.shmem_torch_process_group_init("default")
    except shmem.ShmemError as exc:
        print(f"ok  init refused: {exc}", flush=True)
        return 0
    print("FAIL init succeeded with a UCX without CUDA under MORI_DISABLE_P2P", flush=True)
    shmem.shmem_finalize()
    return 1


if __name__ == "__main__":
    sys.exit(main())
