"""GPU tests, run by every rank under torchrun (ci/device/triton.sh): any number of PEs on any
number of GPUs (PEs beyond the GPU count share GPUs: ci/device/gpu_world.py).

Each rank regenerates every rank's random input from (seed, rank), so references need no
communication: sums are checked bit for bit against an fp32 accumulation in rank order.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
PES_PER_GPU = 1  # set by the world fixture


def _fit(cfg):
    """``cfg`` with its block cap divided among the PEs sharing this GPU.

    The all-reduce kernels wait for their peers' blocks: PEs that share a GPU (under MPS) must
    all be resident at once, so each gets its share of the GPU (the 132-block configuration of 4
    PEs on one H100 waited out MORI_SHMEM_TIMEOUT).
    """
    import dataclasses

    return dataclasses.replace(cfg, max_blocks=max(1, cfg.max_blocks // PES_PER_GPU))


@pytest.fixture(scope="session")
def world():
    import torch.distributed as dist

    import mori.shmem as shmem
    from mori.triton import install_hook

    if "LOCAL_RANK" not in os.environ:
        pytest.fail("GPU tests run under torchrun (ci/device/triton.sh)")
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "ci" / "device"))
    from gpu_world import init_world, pes_per_gpu

    global PES_PER_GPU
    PES_PER_GPU = pes_per_gpu()
    init_world()
    shmem.shmem_torch_process_group_init("default")
    install_hook()
    yield shmem.shmem_mype(), shmem.shmem_npes()
    shmem.shmem_finalize()
    dist.destroy_process_group()


def _input(seed: int, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda", generator=g)
    return torch.randn(shape, dtype=torch.float32, device="cuda", generator=g).to(dtype)


def _reference(seed: int, world_size: int, shape, dtype) -> torch.Tensor:
    acc = _input(seed, 0, shape, dtype).float()
    for r in range(1, world_size):
        acc = acc + _input(seed, r, shape, dtype).float()
    return acc.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{(a != b).sum().item()} elements differ"


@pytest.mark.parametrize("nbytes", [256, 4096 + 12, 1 << 20])
@pytest.mark.parametrize("direction", ["put", "get"])
def test_put_get_ring(world, nbytes, direction):
    import mori.shmem as shmem
    from mori.triton import jit
    from mori.triton.kernels import get_ring_kernel, put_ring_kernel

    rank, n = world
    src = shmem.shmem_tensor((nbytes,), torch.uint8)
    dst = shmem.shmem_tensor((nbytes,), torch.uint8)
    try:
        src.copy_(_input(7, rank, (nbytes,), torch.uint8))
        dst.zero_()
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        per_block = 64 << 10
        grid = (max(1, -(-nbytes // per_block)),)
        kernel = jit(put_ring_kernel if direction == "put" else get_ring_kernel)
        kernel[grid](dst, src, nbytes, per_block)
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        source_rank = (rank - 1) % n if direction == "put" else (rank + 1) % n
        _same_bits(dst, _input(7, source_rank, (nbytes,), torch.uint8))
    finally:
        shmem.shmem_barrier_all()
        shmem.shmem_free(dst.data_ptr())
        shmem.shmem_free(src.data_ptr())


@pytest.mark.parametrize("shape", [(64, 7168), (3, 1000), (1, 64)])
def test_kernel_a_p2p_read(world, shape):
    import mori.shmem as shmem
    from mori.triton import jit
    from mori.triton.kernels import allreduce_p2p_kernel

    rank, n = world
    sym = shmem.shmem_tensor(shape, torch.bfloat16)
    try:
        for it in range(3):
            sym.copy_(_input(it, rank, shape, torch.bfloat16))
            out = torch.empty_like(sym)
            torch.cuda.synchronize()
            shmem.shmem_barrier_all()
            block = 1024
            jit(allreduce_p2p_kernel)[(-(-sym.numel() // block),)](sym, out, sym.numel(), BLOCK=block)
            torch.cuda.synchronize()
            shmem.shmem_barrier_all()
            _same_bits(out, _reference(it, n, shape, torch.bfloat16))
    finally:
        shmem.shmem_free(sym.data_ptr())


@pytest.mark.parametrize("shape", [(64, 7168), (8, 1024)])
def test_kernel_b_put_signal(world, shape):
    import mori.shmem as shmem
    from mori.triton import jit
    from mori.triton.kernels import allreduce_put_signal_kernel

    rank, n = world
    sym_in = shmem.shmem_tensor(shape, torch.bfloat16)
    # The seed's grid choice: P2P peers take 8 chunks each (grid 8 n); when the host sees no P2P
    # address for a peer (another host, or MORI_DISABLE_P2P: "IBGDA mode", here the device proxy)
    # one block per PE (CHUNKS_PER_PE=1, grid n).
    p2p = all(shmem.shmem_ptr_p2p(sym_in.data_ptr(), rank, pe) != 0 for pe in range(n))
    cpp = 8 if p2p else 1
    recv = shmem.shmem_tensor((n, *shape), torch.bfloat16)
    sig = shmem.shmem_tensor((1,), torch.uint64)
    try:
        sig.zero_()
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        for epoch in range(1, 4):
            sym_in.copy_(_input(epoch, rank, shape, torch.bfloat16))
            out = torch.empty_like(sym_in)
            jit(allreduce_put_signal_kernel)[(n * cpp,)](
                sym_in, recv, sig, out, sym_in.numel(), epoch, CHUNKS_PER_PE=cpp, BLOCK=1024
            )
            torch.cuda.synchronize()
            shmem.shmem_barrier_all()  # nobody overwrites recv before every PE has reduced
            _same_bits(out, _reference(epoch, n, shape, torch.bfloat16))
    finally:
        for t in (sig, recv, sym_in):
            shmem.shmem_free(t.data_ptr())


# (one_shot, block, num_warps, max_blocks, kernel): v2 and v3 of both algorithms; small grids make
# every block loop over several tiles, the 132-block one is the large-size shape. Every config
# runs bf16; the small-grid v2 ones (which cover the most code paths) every dtype.
_SMALL_GRID = [(True, 1024, 4, 8, k) for k in ("v2", "v3")] + [(False, 1024, 4, 8, k) for k in ("v2", "v3")]
ALL_REDUCE_CASES = [
    ("bfloat16", c)
    for c in [
        *_SMALL_GRID,
        (True, 2048, 8, 64, "v2"),
        (False, 4096, 8, 132, "v2"),
        (True, 2048, 8, 64, "v3"),
        (False, 1024, 4, 128, "v3"),
    ]
]
ALL_REDUCE_CASES += [(d, c) for d in ("float16", "float32") for c in _SMALL_GRID]


@pytest.mark.parametrize("shape", [(64, 7168), (5, 333), (1024, 4096)])
@pytest.mark.parametrize(
    "dtype,config",
    ALL_REDUCE_CASES,
    ids=lambda c: f"{'1shot' if c[0] else '2shot'}-{c[4]}-b{c[1]}w{c[2]}g{c[3]}" if isinstance(c, tuple) else c,
)
def test_all_reduce_exact(world, dtype, shape, config):
    from mori.triton import AllReduce
    from mori.triton._all_reduce import AllReduceConfig

    rank, n = world
    op = AllReduce(max_bytes=32 << 20, one_shot_max_bytes=32 << 20, lamport_max_bytes=32 << 20)
    try:
        cfg = _fit(AllReduceConfig(*config))
        for it in range(4):  # repeated calls exercise the epochs, the slot parity and the cached launch
            x = _input(100 + it, rank, shape, DTYPES[dtype])
            # odd calls in place, even ones into a fresh output
            out = op(x, cfg=cfg) if it % 2 else op(x, out=torch.empty_like(x), cfg=cfg)
            torch.cuda.synchronize()
            _same_bits(out, _reference(100 + it, n, shape, DTYPES[dtype]))
        # back to back without host synchronisation: a PE may run one call ahead of another
        xs = [_input(300 + it, rank, shape, DTYPES[dtype]) for it in range(6)]
        outs = [op(x, out=torch.empty_like(x), cfg=cfg) for x in xs]
        torch.cuda.synchronize()
        for it, out in enumerate(outs):
            _same_bits(out, _reference(300 + it, n, shape, DTYPES[dtype]))
    finally:
        op.close()


def test_all_reduce_v3_mixed_sizes_and_sentinel_inputs(world):
    """v3 calls of different sizes, algorithms and grids back to back share one slot area (its
    sets rotate per block); inputs holding the sentinel's bit pattern give NaN there, exact sums
    elsewhere; a v3 config is refused above lamport_max_bytes."""
    from mori.triton import AllReduce
    from mori.triton._all_reduce import AllReduceConfig

    rank, n = world
    op = AllReduce(max_bytes=8 << 20, one_shot_max_bytes=1 << 20, lamport_max_bytes=2 << 20)
    try:
        plan = [
            ((64, 7168), AllReduceConfig(False, 1024, 4, 112, "v3")),
            ((3, 1000), AllReduceConfig(True, 1024, 4, 3, "v3")),
            ((256, 4096), AllReduceConfig(False, 2048, 4, 64, "v3")),
            ((64, 7168), AllReduceConfig(True, 2048, 8, 64, "v3")),
            ((64, 7168), AllReduceConfig(False, 1024, 4, 112, "v2")),
        ] * 3
        plan = [(shape, _fit(cfg)) for shape, cfg in plan]
        xs = [_input(500 + i, rank, shape, torch.bfloat16) for i, (shape, _) in enumerate(plan)]
        outs = [op(x, out=torch.empty_like(x), cfg=cfg) for x, (_, cfg) in zip(xs, plan)]
        torch.cuda.synchronize()
        for i, (out, (shape, _)) in enumerate(zip(outs, plan)):
            _same_bits(out, _reference(500 + i, n, shape, torch.bfloat16))
        shape, cfg = (64, 7168), _fit(AllReduceConfig(False, 1024, 4, 112, "v3"))
        x = _input(600, rank, shape, torch.bfloat16)
        hit = torch.zeros(shape, dtype=torch.bool, device="cuda").view(-1)
        hit[rank::97] = True
        hit = hit.view(shape)
        x.view(torch.int16)[hit] = -1  # the sentinel's bits
        out = op(x, out=torch.empty_like(x), cfg=cfg)
        torch.cuda.synchronize()
        # on CPU tensors: PEs sharing a GPU have a gloo group only
        hits = [torch.zeros(shape, dtype=torch.uint8) for _ in range(n)]
        torch.distributed.all_gather(hits, hit.to(torch.uint8).cpu())
        nan = torch.stack(hits).bool().any(0).cuda()
        assert torch.isnan(out[nan]).all()
        assert torch.equal(
            out[~nan].view(torch.int16), _reference(600, n, shape, torch.bfloat16)[~nan].view(torch.int16)
        )
        with pytest.raises(ValueError, match="lamport_max_bytes"):
            op(torch.ones(4 << 20, dtype=torch.bfloat16, device="cuda"), cfg=cfg)
    finally:
        op.close()


def test_all_reduce_default_and_graph(world):
    from mori.triton import all_reduce

    rank, n = world
    shape = (64, 7168)
    x = _input(5, rank, shape, torch.bfloat16)
    _same_bits(all_reduce(x.clone()), _reference(5, n, shape, torch.bfloat16))
    buf = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        buf.copy_(x)
        all_reduce(buf)  # warm up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_reduce(buf)
    for it in range(3):
        buf.copy_(_input(200 + it, rank, shape, torch.bfloat16))
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        _same_bits(buf, _reference(200 + it, n, shape, torch.bfloat16))


def test_all_reduce_rejects_bad_input(world):
    from mori.triton import all_reduce

    with pytest.raises(TypeError, match="CUDA torch.Tensor"):
        all_reduce(torch.ones(4))
    with pytest.raises(TypeError, match="supports"):
        all_reduce(torch.ones(4, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        all_reduce(torch.ones(4, 4, dtype=torch.bfloat16, device="cuda").t())
    with pytest.raises(ValueError, match="max_bytes"):
        all_reduce(torch.ones(65 << 20, dtype=torch.uint8, device="cuda").view(torch.bfloat16))


def test_llvm_ir_put_ring(world):
    import mori.shmem as shmem
    from mori.triton import IrModule, compile_ir
    from mori.triton.kernels import PUT_RING_IR

    rank, n = world
    nbytes = 1 << 16
    _, cubin = compile_ir(PUT_RING_IR)
    module = IrModule(cubin)
    src = shmem.shmem_tensor((nbytes,), torch.uint8)
    dst = shmem.shmem_tensor((nbytes,), torch.uint8)
    try:
        src.copy_(_input(9, rank, (nbytes,), torch.uint8))
        dst.zero_()
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        module.launch(
            "mori_ir_put_ring",
            1,
            256,
            [(dst.data_ptr(), "i64"), (src.data_ptr(), "i64"), (nbytes, "i64")],
            stream=torch.cuda.current_stream().cuda_stream,
        )
        torch.cuda.synchronize()
        shmem.shmem_barrier_all()
        _same_bits(dst, _input(9, (rank - 1) % n, (nbytes,), torch.uint8))
    finally:
        shmem.shmem_barrier_all()
        shmem.shmem_free(dst.data_ptr())
        shmem.shmem_free(src.data_ptr())
        module.unload()


def test_hook_initialised_triton_modules(world):
    from mori.triton._runtime import loaded_modules

    device = torch.cuda.current_device()
    assert any(dev == device for _, dev in loaded_modules())
