"""The NVLink backend's parts that need no GPU: the copy plan (checked by replaying it on host
memory, byte for byte), the gather kernel's compilation by NVRTC, and configuration errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mori.core import cuda as _cuda
from mori.core.batch import Batch
from mori.io import BackendType, IOEngine, IOEngineConfig, XgmiBackendConfig
from mori.io.backends.nvlink._kernels import KERNEL_NAME, compile_cubin
from mori.io.backends.nvlink.plan import KERNEL_PIECE, plan_batch, plan_copies

SRC_BASE, DST_BASE = 1 << 20, 9 << 20  # two disjoint regions of one simulated address space
MAX_TOTAL = 20 << 20
MEMORY = np.random.default_rng(0).integers(0, 256, DST_BASE + MAX_TOTAL + (1 << 16), dtype=np.uint8)


def _replay(plan, memory: np.ndarray) -> np.ndarray:
    out = memory.copy()
    rows = [plan.kernel, *plan.engines]
    for src, dst, n in (r for part in rows for r in part.tolist()):
        out[dst : dst + n] = memory[src : src + n]
    return out


@st.composite
def _batches(draw):
    n = draw(st.integers(0, 60))
    sizes = draw(st.lists(st.sampled_from([0, 1, 3, 16, 4096, 65535, 65536, 300_001, 3 << 20]), min_size=n, max_size=n))
    while sum(sizes) > MAX_TOTAL:  # keep the simulated memory small
        sizes.pop()
    n = len(sizes)
    contiguous = draw(st.booleans())
    order = draw(st.permutations(range(n)))
    # Destination slots never overlap; sources may (a read-only region).
    src_offs, dst_offs, pos = [], [], 5
    for i in range(n):
        src_offs.append(pos if contiguous else draw(st.integers(0, (7 << 20) - sizes[i])))
        pos += sizes[i]
    slot_starts = np.cumsum([0] + [sizes[j] + (0 if contiguous else 7) for j in order])[:-1]
    starts = dict(zip(order, slot_starts.tolist()))
    dst_offs = [1 + starts[i] for i in range(n)] if not contiguous else [11 + sum(sizes[:i]) for i in range(n)]
    return src_offs, dst_offs, sizes


@settings(max_examples=150, deadline=None)
@given(
    batch=_batches(),
    kernel_max=st.sampled_from([0, 1, 4096, 65536, 1 << 40]),
    stripe=st.sampled_from([4096, 1 << 20]),
    streams=st.integers(1, 9),
)
def test_plan_moves_exactly_the_blocks(batch, kernel_max, stripe, streams):
    src_offs, dst_offs, sizes = batch
    memory = MEMORY
    expect = memory.copy()
    for s, d, n in zip(src_offs, dst_offs, sizes):
        expect[DST_BASE + d : DST_BASE + d + n] = memory[SRC_BASE + s : SRC_BASE + s + n]
    plan = plan_copies(SRC_BASE, DST_BASE, src_offs, dst_offs, sizes, kernel_max, stripe, streams)
    assert np.array_equal(_replay(plan, memory), expect)
    assert plan.total_bytes == sum(sizes)
    assert all(int(n) < kernel_max for n in plan.kernel[:, 2])
    # the kernel cuts each row into kernel_per_row pieces (a lone row: as many as it needs)
    assert len(plan.kernel) <= 1 or all(int(n) <= KERNEL_PIECE * plan.kernel_per_row for n in plan.kernel[:, 2])
    assert len(plan.engines) <= streams
    for lane in plan.engines:
        assert len(lane) and (lane[:, 2] > 0).all() and (lane[:, 2] <= stripe).all()


@settings(max_examples=60, deadline=None)
@given(batch=_batches(), kernel_max=st.sampled_from([0, 65536, 1 << 40]), read=st.booleans())
def test_a_transfers_rows_plan_as_its_columns(batch, kernel_max, read):
    """A transfer's rows (local address, remote offset, bytes), the remote region mapped at some
    address: a write copies local -> remote, a read remote -> local, as plan_copies of the columns."""
    local_offs, remote_offs, sizes = batch
    if read:  # the source is the remote region
        local_offs, remote_offs = remote_offs, local_offs
    local_base, remote_base = (DST_BASE, SRC_BASE) if read else (SRC_BASE, DST_BASE)
    rows = Batch(local_offs, remote_offs, sizes, local_base)
    plan = plan_batch(rows, remote_base, read, kernel_max, 1 << 20, 4)
    expect = MEMORY.copy()
    for lo, ro, n in zip(local_offs, remote_offs, sizes):
        src, dst = (remote_base + ro, local_base + lo) if read else (local_base + lo, remote_base + ro)
        expect[dst : dst + n] = MEMORY[src : src + n]
    assert np.array_equal(_replay(plan, MEMORY), expect)
    assert plan.total_bytes == sum(sizes)


def test_plan_merges_contiguous_blocks_and_stripes_large_ones():
    n, size = 1024, 256 << 10
    offs = [i * size for i in range(n)]
    plan = plan_copies(0x1000, 0x8000_0000, offs, offs, [size] * n, 64 << 10, 8 << 20, 8)
    assert len(plan.kernel) == 0
    assert len(plan.engines) == 8  # one 256 MiB block, cut into 32 pieces over 8 streams
    assert sum(len(e) for e in plan.engines) == 32
    assert all(int(b) == 32 << 20 for b in (e[:, 2].sum() for e in plan.engines))
    shuffled = list(reversed(offs))
    plan = plan_copies(0x1000, 0x8000_0000, offs, shuffled, [4096] * n, 64 << 10, 8 << 20, 8)
    assert len(plan.kernel) == n and not plan.engines
    plan = plan_copies(0x1000, 0x8000_0000, offs, shuffled, [size] * n, 1 << 20, 8 << 20, 8)
    assert len(plan.kernel) == n and plan.kernel_per_row == size // KERNEL_PIECE and not plan.engines  # cut in-kernel
    sizes = [size] + [16] * (n - 1)  # one long row and many short ones: cut on the host
    plan = plan_copies(0x1000, 0x8000_0000, offs, shuffled, sizes, 1 << 20, 8 << 20, 8)
    assert len(plan.kernel) == n - 1 + size // KERNEL_PIECE and plan.kernel_per_row == 1


def test_plan_writes_kernel_rows_into_the_given_table():
    n, size = 512, 64 << 10
    src = (n - 1 - np.arange(n, dtype=np.int64)) * size  # reversed: no two blocks merge
    dst = np.arange(n, dtype=np.int64) * size
    table = np.zeros((1024, 3), dtype=np.uint64)
    plan = plan_copies(0x1000, 0x8000_0000, src, dst, np.full(n, size, dtype=np.int64), 1 << 20, 8 << 20, 4, table)
    assert plan.in_out and np.shares_memory(plan.kernel, table) and len(plan.kernel) == n
    assert table[:n, 0].tolist() == (src + 0x1000).tolist() and (table[:n, 2] == size).all()
    # Rows large enough for the copy engines: the kernel's share is a copy, the table unused.
    mixed = np.where(np.arange(n) % 2 == 0, size, 4 << 20).astype(np.int64)
    far = np.arange(n, dtype=np.int64) * (8 << 20)
    plan = plan_copies(0x1000, 0x8000_0000, far, far[::-1].copy(), mixed, 1 << 20, 8 << 20, 4, table)
    assert not plan.in_out and len(plan.kernel) == n // 2 and sum(len(e) for e in plan.engines) == n // 2
    # A share of a batch of large rows goes to the copy engines beside the kernel: the last rows.
    big = 256 << 10
    src_big = (n - 1 - np.arange(n, dtype=np.int64)) * big
    plan = plan_copies(
        0x1000,
        0x8000_0000,
        src_big,
        np.arange(n, dtype=np.int64) * big,
        np.full(n, big, dtype=np.int64),
        1 << 20,
        8 << 20,
        4,
        table,
        engine_share=0.25,
    )
    assert plan.in_out and len(plan.kernel) == n - n // 4 and len(plan.engines) == 1
    assert np.shares_memory(plan.engines[0], table) and len(plan.engines[0]) == n // 4
    assert plan.total_bytes == n * big
    assert table[n - n // 4, 0] == 0x1000 + int(src_big[n - n // 4])
    # ... not for small rows (a copy-engine copy of 64 KiB costs more than it brings) or few rows.
    plan = plan_copies(
        0x1000, 0x8000_0000, src, dst, np.full(n, size, dtype=np.int64), 1 << 20, 8 << 20, 4, table, engine_share=0.25
    )
    assert len(plan.kernel) == n and not plan.engines
    plan = plan_copies(
        0x1000,
        0x8000_0000,
        src_big[:8],
        dst[:8] * 4,
        np.full(8, big, dtype=np.int64),
        1 << 20,
        8 << 20,
        4,
        table,
        engine_share=0.25,
    )
    assert len(plan.kernel) == 8 and not plan.engines
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        plan_copies(0, 0, src, dst, np.full(n, size, dtype=np.int64), 1 << 20, 8 << 20, 4, table[:, :2])
    with pytest.raises(ValueError, match="C-contiguous uint64"):
        plan_copies(0, 0, src, dst, np.full(n, size, dtype=np.int64), 1 << 20, 8 << 20, 4, table.astype(np.int64))


def test_plan_rejects_bad_parameters():
    with pytest.raises(ValueError, match="stripe=0"):
        plan_copies(0, 0, [0], [0], [1], 1, 0, 1)


def test_gather_kernel_compiles_with_nvrtc():
    cubin = compile_cubin("sm_90")
    assert cubin[:4] == b"\x7fELF"
    assert KERNEL_NAME.encode() in cubin


def test_config_errors_are_clear():
    with IOEngine("cfg", IOEngineConfig()) as engine:
        with pytest.raises(TypeError, match="XgmiBackendConfig"):
            engine.create_backend(BackendType.XGMI, {"num_streams": 4})
        with pytest.raises(ValueError, match="num_streams=0"):
            engine.create_backend(BackendType.NVLINK, XgmiBackendConfig(num_streams=0))


def _gpus() -> int:
    try:
        _cuda.call("cuInit", 0)
        return int(_cuda.call("cuDeviceGetCount"))
    except (_cuda.CudaUnavailableError, _cuda.CudaError):
        return 0


def test_backend_without_gpus_fails_clearly():
    """On a machine with no GPU, creating the backend says why; with GPUs it is created."""
    with IOEngine("nogpu", IOEngineConfig()) as engine:
        if _gpus():
            engine.create_backend(BackendType.XGMI)
            engine.remove_backend(BackendType.XGMI)
        else:
            with pytest.raises((_cuda.CudaUnavailableError, RuntimeError), match="CUDA|libcuda|GPU"):
                engine.create_backend(BackendType.XGMI)
