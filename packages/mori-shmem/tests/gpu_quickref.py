"""The MORI shmem guide's Method 1 and Quick Reference, as written, under torchrun.

Two changes let several PEs share a GPU: the device is LOCAL_RANK modulo the GPU count, and the
backend is gloo when PEs share a GPU (NCCL refuses two ranks on one device): gpu_world.py.
"""

import os

import torch
import torch.distributed as dist
from gpu_world import pe_device, process_group_backend

import mori

rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(pe_device())
size_in_bytes = 1 << 20
tensor = torch.zeros(1024, 7168, dtype=torch.bfloat16, device="cuda")

# --- Method 1 (guide section 2) ---
dist.init_process_group(backend=process_group_backend(), rank=rank, world_size=world_size)
world_group = dist.group.WORLD
torch._C._distributed_c10d._register_process_group("default", world_group)

# --- Quick Reference ---
# Initialize from PyTorch process group
mori.shmem.shmem_torch_process_group_init("default")

# Query
my_rank = mori.shmem.shmem_mype()
num_ranks = mori.shmem.shmem_npes()

# Allocate symmetric memory
ptr = mori.shmem.shmem_malloc(size_in_bytes)

# Register existing buffer for RDMA
mori.shmem.shmem_buffer_register(tensor.data_ptr(), tensor.nbytes)

# P2P address translation (intra-node)
my_pe, dest_pe = my_rank, (my_rank + 1) % num_ranks
remote_ptr = mori.shmem.shmem_ptr_p2p(ptr, my_pe, dest_pe)

# Synchronize
mori.shmem.shmem_barrier_all()

# (beyond the guide: prove remote_ptr reaches the neighbour's memory)
torch.cuda.synchronize()
assert (my_rank, num_ranks) == (rank, world_size) and remote_ptr != 0
mori.shmem.shmem_putmem(ptr, bytes([my_rank + 1]) * 64, my_rank)
mori.shmem.shmem_barrier_all()
assert mori.shmem.shmem_getmem(ptr, 64, dest_pe) == bytes([dest_pe + 1]) * 64
mori.shmem.shmem_barrier_all()
assert mori.shmem.shmem_buffer_deregister(tensor.data_ptr(), tensor.nbytes) == 0

# Cleanup
mori.shmem.shmem_free(ptr)
mori.shmem.shmem_finalize()
dist.destroy_process_group()
print(f"quick reference ok on rank {rank}/{world_size}", flush=True)
