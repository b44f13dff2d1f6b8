"""GPU checks of mori.shmem: one process per PE, started by torchrun (see test_gpu.py).

Initializes as the MORI guide's Method 1 (torch process group registered as "default"; when PEs
share a GPU the group is gloo: ci/device/gpu_world.py), then runs (1) device-API kernels compiled
by NVRTC against mori's headers: put ring, get ring, put with signal + wait_until, fetch-add from
every PE, device barrier, p/g/ptr and shmem_barrier_on_stream; (2) the CPU suite's host-API and
RMA checks on the GPU heap; (3) tensors on the heap; (4) finalize and init again. One
put-with-signal waits on the device while the host thread lazily loads a kernel and reads a
tensor behind it (the deadlock the remote transport's own CUDA context avoids). Heap mode comes
from MORI_SHMEM_MODE. Prints one line per passed check on rank 0 and exits non-zero on the first
failure. With MORI_DISABLE_P2P set, every peer is reached through the remote transport: the same
kernels go through the device proxy, host calls through the UCX engine, and the checks of what
P2P alone gives (peer pointers and tensors) expect their refusals instead.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path
from typing import Any

import test_host_api
import test_rma
import torch
import torch.distributed as dist
from gpu_world import init_world

import mori.shmem as shmem
from mori.core import cuda as cu
from mori.shmem import _state
from mori.shmem._cuda import launch
from mori.shmem._kernels import load_module

RANK = int(os.environ["RANK"])
# MORI_DISABLE_P2P: every peer is reached through the remote transport (kernels: the device proxy).
REMOTE = os.environ.get("MORI_DISABLE_P2P", "").lower() in ("on", "1", "true")


class TorchPool:
    """The PePool interface over torchrun's processes: each runs fn, results gathered by rank."""

    def __init__(self) -> None:
        self.n = dist.get_world_size()

    def run(self, fn: Any, *args: Any) -> list[Any]:
        result = fn(*args)
        out: list[Any] = [None] * self.n
        dist.all_gather_object(out, result)
        return out

    def init(self) -> None:
        shmem.shmem_torch_process_group_init("default")


def ok(name: str) -> None:
    if RANK == 0:
        print(f"ok  {name} ({os.environ.get('MORI_SHMEM_MODE', 'static')}, {dist.get_world_size()} PEs)", flush=True)


def expect(name: str, cond: bool, detail: Any = "") -> None:
    if not cond:
        raise AssertionError(f"{name} failed on PE {RANK}: {detail}")


class Kernels:
    def __init__(self) -> None:
        ctx = _state.current().ctx
        source = (Path(__file__).parent / "gpu_kernels.cu").read_text()
        self.module = load_module(ctx, source, "gpu_kernels.cu")
        shmem.shmem_module_init(int(self.module))  # an int handle, as Triton passes it

    def __call__(self, name: str, grid: int, block: int, *args: Any) -> None:
        fn = cu.call("cuModuleGetFunction", self.module, name.encode())
        # The device API's register use decides how many threads a block may have: stay within it.
        limit = cu.call(
            "cuFuncGetAttribute", cu.driver().CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, fn
        )
        block = min(block, int(limit))
        c_args = [a if isinstance(a, ctypes._SimpleCData) else ctypes.c_uint64(a) for a in args]
        launch(fn, grid, block, c_args, torch.cuda.current_stream().cuda_stream)


def sync_all() -> None:
    torch.cuda.synchronize()
    shmem.shmem_barrier_all()


def rand_bytes(nbytes: int, seed: int, dev: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=dev).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=gen)


def device_api_checks(k: Kernels, nbytes: int) -> None:
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    left, right = (me - 1) % n, (me + 1) % n
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = shmem.shmem_tensor(nbytes, torch.uint8)

    src = rand_bytes(nbytes, 100 + me, dev)
    sync_all()
    k("put_ring", 64, 512, buf.data_ptr(), src.data_ptr(), nbytes)
    sync_all()
    expect("put ring", torch.equal(buf, rand_bytes(nbytes, 100 + left, dev)))
    ok(f"device put ring, {nbytes} bytes, 64 blocks")

    buf.copy_(rand_bytes(nbytes, 200 + me, dev))
    out = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    sync_all()
    k("get_ring", 64, 512, out.data_ptr(), buf.data_ptr(), nbytes)
    sync_all()
    expect("get ring", torch.equal(out, rand_bytes(nbytes, 200 + right, dev)))
    ok("device get ring")

    msg_bytes = 1 << 20
    sig = shmem.shmem_tensor(1, torch.int64)
    sig.zero_()
    for rnd in (1, 2, 3):
        src = rand_bytes(msg_bytes, 300 * rnd + me, dev)
        got = torch.zeros(msg_bytes, dtype=torch.uint8, device=dev)
        sync_all()
        k("put_signal_ring", 1, 1024, buf.data_ptr(), src.data_ptr(), msg_bytes, sig.data_ptr(), rnd, got.data_ptr())
        sync_all()
        expect("put with signal", torch.equal(got, rand_bytes(msg_bytes, 300 * rnd + left, dev)), f"round {rnd}")
    ok("device put-with-signal + wait_until, 3 rounds")

    # The kernel waits for the left PE's put (its proxy and this PE's engine move the bytes) while
    # this host thread holds the primary context's lock: a torch kernel used for the first time
    # (its lazy load waits for the GPU to drain) and a copy to pageable memory behind the kernel
    # (.item()). The engine's copies run in a context of their own: before, this deadlocked.
    heap_src = shmem.shmem_tensor(msg_bytes, torch.uint8)
    heap_src.copy_(rand_bytes(msg_bytes, 999 + me, dev))
    got = torch.zeros(msg_bytes, dtype=torch.uint8, device=dev)
    sync_all()
    k("put_signal_ring", 1, 1024, buf.data_ptr(), heap_src.data_ptr(), msg_bytes, sig.data_ptr(), 4, got.data_ptr())
    j0 = torch.special.bessel_j0(torch.zeros(4, device=dev)).sum().item()
    sync_all()
    expect("put with signal behind a lazy load", torch.equal(got, rand_bytes(msg_bytes, 999 + left, dev)) and j0 == 4.0)
    ok("device put-with-signal while the host lazily loads a kernel and reads behind it")
    shmem.shmem_free(heap_src.data_ptr())

    # Up to 8 bytes travel in the proxy's command, with the signal (no copy out of the GPU): from
    # memory outside the heap, and the bytes after them untouched.
    for rnd, small in ((5, 1), (6, 5), (7, 8)):
        buf[:64].fill_(0xAB)
        src = rand_bytes(small, 300 * rnd + me, dev)
        got = torch.zeros(small, dtype=torch.uint8, device=dev)
        sync_all()
        k("put_signal_ring", 1, 1024, buf.data_ptr(), src.data_ptr(), small, sig.data_ptr(), rnd, got.data_ptr())
        sync_all()
        landed = torch.equal(got, rand_bytes(small, 300 * rnd + left, dev)) and bool((buf[small:64] == 0xAB).all())
        expect("small put with signal", landed, f"{small} bytes")
    ok("device put-with-signal of 1, 5 and 8 bytes")

    counters = shmem.shmem_tensor(2, torch.int64)
    counters.zero_()
    olds = torch.zeros(8 * 128, dtype=torch.int64, device=dev)
    sync_all()
    k("fetch_add_all", 8, 128, counters.data_ptr(), counters.data_ptr() + 8, olds.data_ptr())
    sync_all()
    total = n * 8 * 128
    c32 = counters[1:2].view(torch.int32)[0].item()
    expect("fetch-add", counters[0].item() == total and c32 == total, (counters[0].item(), c32))
    expect("fetch-add olds distinct", olds.unique().numel() == olds.numel())
    ok("device fetch-add (64 and 32 bit) from every PE")

    slots = shmem.shmem_tensor(64, torch.int64)
    slots.zero_()
    errors = torch.zeros(1, dtype=torch.int32, device=dev)
    sync_all()
    k("barrier_rounds", 1, 128, slots.data_ptr(), ctypes.c_int(50), errors.data_ptr())
    sync_all()
    expect("device barrier", errors.item() == 0 and bool(torch.all(slots[:n] == 50)), errors.item())
    ok("device barrier, 50 rounds")

    word = shmem.shmem_tensor(1, torch.int64)
    word.zero_()
    pg = torch.zeros(2, dtype=torch.int64, device=dev)
    sync_all()
    k("p_g_ptr", 1, 1, word.data_ptr(), pg.data_ptr())
    sync_all()
    # Through the proxy ShmemPtr has no address for a peer: the kernel reads ~0 instead.
    expect("p/g/ptr", pg.tolist() == [left + 1, -1 if REMOTE else (me - 2) % n + 1], pg.tolist())
    ok("device p, g, ShmemPtr" + (" (0 for every peer: all through the proxy)" if REMOTE else ""))

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for rnd in range(1, 6):
            k("p_right", 1, 1, word.data_ptr(), 1000 * rnd + me)
            shmem.shmem_barrier_on_stream(stream)
            seen = word.clone()
            shmem.shmem_barrier_on_stream(stream)
            expect("barrier on stream", seen.item() == 1000 * rnd + left, (rnd, seen.item()))
    ok("shmem_barrier_on_stream orders device puts")
    sync_all()
    for t in (buf, sig, counters, slots, word):
        shmem.shmem_free(t.data_ptr())


def host_rma_checks(pool: TorchPool) -> None:
    results = pool.run(test_rma.pe_put_ring, 7, 65536, 3)
    for r, (_, got) in enumerate(results):
        expect("host put ring", got == results[(r - 1) % pool.n][0])
    for test in (
        test_rma.test_get_from_every_pe,
        test_rma.test_put_signal_wait,
        test_rma.test_wait_until_all_comparisons,
        test_rma.test_wait_until_timeout,
        test_rma.test_bad_input_changes_nothing,
        test_rma.test_address_error_names_the_heap,
        test_rma.test_quiet_and_fence,
        test_host_api.test_queries,
        test_host_api.test_malloc_variants,
        test_host_api.test_buffer_register,
        test_host_api.test_barrier_ordering,
        test_host_api.test_double_init_rejected,
    ):
        test(pool)
        ok(f"host API on the GPU heap: {test.__name__}")
    for width in (32, 64):
        test_rma.test_atomics(pool, width)
        ok(f"host atomics on the GPU heap, {width} bit")


def tensor_checks() -> None:
    me, n = shmem.shmem_mype(), shmem.shmem_npes()
    t = shmem.shmem_tensor((64, 7168), torch.bfloat16)
    t.fill_(float(me))
    src = torch.full((64, 7168), float(me + 10), dtype=torch.bfloat16, device=t.device)
    sync_all()
    for pe in range(n):
        if REMOTE and pe != me:
            try:
                shmem.shmem_peer_tensor(t, pe)
            except ValueError:
                continue
            raise AssertionError(f"shmem_peer_tensor of PE {pe} on PE {me} did not refuse a PE reached remotely")
        expect("peer tensor", bool(torch.all(shmem.shmem_peer_tensor(t, pe) == float(pe))), pe)
    sync_all()
    shmem.shmem_putmem(t, src, (me + 1) % n)  # a CUDA tensor as the source of a host put
    sync_all()
    expect("put from CUDA tensor", bool(torch.all(t == float((me - 1) % n + 10))))
    # Registered with shmem_buffer_register, a CUDA tensor and a host one move as they are: the
    # remote transport neither stages them nor registers them for the call.
    host = torch.full((64, 7168), float(me + 20), dtype=torch.bfloat16)
    for buffer, offset in ((src, 10), (host, 20)):  # each PE's buffer holds its rank + offset
        sync_all()
        assert shmem.shmem_buffer_register(buffer.data_ptr(), buffer.nbytes) == 0
        before = shmem.shmem_heap_info()["remote_stats"]
        shmem.shmem_putmem(t, buffer, (me + 1) % n)
        after = shmem.shmem_heap_info()["remote_stats"]
        sync_all()
        expect("put from a registered buffer", bool(torch.all(t == float((me - 1) % n + offset))))
        moved = {k: after[k] - before[k] for k in ("staged", "registered_for_call")}
        expect("registered buffer moved as is", not REMOTE or moved == {"staged": 0, "registered_for_call": 0}, moved)
        assert shmem.shmem_buffer_deregister(buffer.data_ptr(), buffer.nbytes) == 0
    expect(
        "ptr_p2p", all((shmem.shmem_ptr_p2p(t.data_ptr(), me, pe) != 0) == (pe == me or not REMOTE) for pe in range(n))
    )
    info = shmem.shmem_heap_info()
    expect("heap kind", info["kind"] == "gpu" and info["mode"] == os.environ.get("MORI_SHMEM_MODE", "static"), info)
    sync_all()
    shmem.shmem_free(t.data_ptr())
    ok("tensors on the GPU heap, peer views, CUDA-tensor put")


def main() -> int:
    init_world()
    pool = TorchPool()
    pool.init()
    device_api_checks(Kernels(), int(sys.argv[1]) if len(sys.argv) > 1 else (8 << 20) + 13)
    heap = _state.current().heap
    if os.environ.get("MORI_SHMEM_MODE") == "vmm":
        # The 8 MiB buffers needed chunks beyond the first: the peers mapped them too (or the ring failed).
        expect("vmm growth", heap.chunk < heap.mapped < heap.size, (heap.chunk, heap.mapped, heap.size))
        ok(f"vmm heap grew to {heap.mapped >> 20} MiB in {heap.chunk >> 20} MiB chunks")
    host_rma_checks(pool)
    tensor_checks()
    test_host_api.test_finalize_then_reinit(pool)
    ok("finalize, then init again")
    shmem.shmem_finalize()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
